"""The `bottleneck` feature: its math and its plugin."""
