"""The `agg` feature: its math and its plugin."""
