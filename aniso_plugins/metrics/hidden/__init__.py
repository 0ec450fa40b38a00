"""The `hidden` feature: its math and its plugin."""
