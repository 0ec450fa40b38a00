"""`nonfinite_count`, the geometry plugin's count of NaN / ±inf head entries: exact against
NumPy, and blockwise (no (V, d) temporary; docs/performance.md §7.7)."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

from aniso_plugins.metrics.geometry.stats import BLOCK_ROWS, nonfinite_count

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from measure import PeakMemory


def test_nonfinite_count_matches_numpy_across_blocks():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3 * BLOCK_ROWS + 5, 7, dtype=torch.float64, generator=g)
    flat = w.view(-1)
    picks = torch.randperm(flat.numel(), generator=g)[:40]
    flat[picks[:15]] = float("nan")
    flat[picks[15:30]] = float("inf")
    flat[picks[30:]] = -float("inf")
    w[-1, 0] = float("nan")  # in the short last block
    got = nonfinite_count(w)
    assert got.dtype == torch.float64 and got.dim() == 0
    assert float(got) == np.count_nonzero(~np.isfinite(w.numpy())) == 41
    assert float(nonfinite_count(torch.randn(10, 3))) == 0.0


def test_nonfinite_count_holds_one_block_at_a_time():
    """131072 × 256 float32 rows: the full-matrix count made a 256 MiB int64 copy; the
    blockwise one stays under one block's masks (2 MiB here) plus allocator slack."""
    w = torch.randn(131072, 256)
    w[5, 5] = float("nan")
    nonfinite_count(w)
    with PeakMemory(torch.device("cpu")) as peak:
        count = nonfinite_count(w)
    assert float(count) == 1.0
    assert peak.bytes < 16 * 2**20
