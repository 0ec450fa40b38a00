"""The `simctg` feature: its math and its plugin."""
