"""The `uniformity` feature: its math and its plugin."""
