"""The `regularizers` feature: its math and its plugin."""
