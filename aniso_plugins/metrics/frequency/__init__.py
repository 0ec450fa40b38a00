"""The `frequency` feature: its math and its plugin."""
