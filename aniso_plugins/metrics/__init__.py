"""Metrics, one package each: its math and its plugin."""
