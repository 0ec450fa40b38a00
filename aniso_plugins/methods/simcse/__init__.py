"""The `simcse` feature: its math and its plugin."""
