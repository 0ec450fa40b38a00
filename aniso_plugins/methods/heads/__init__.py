"""The `heads` feature: its math and its plugin."""
