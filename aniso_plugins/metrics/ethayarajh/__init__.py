"""The `ethayarajh` feature: its math and its plugin."""
