"""Coupled Adam: the output embedding's second moment averaged over the vocabulary (Stollenwerk & Stollenwerk 2025)."""
