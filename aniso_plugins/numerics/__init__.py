"""Shared numerics: float64 linear algebra, reducible statistics, distributed rows."""
