"""The `evaluation` feature: its math and its plugin."""
