"""The `geometry` feature: its math and its plugin."""
