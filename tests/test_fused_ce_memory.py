"""Peak memory of `fused_linear_cross_entropy`: one logits tile beyond its outputs (dX, dW), no (N, d)
copies of the hidden states (docs/performance.md §7.3); by default at the floor of PyTorch's own
``F.linear_cross_entropy`` (docs/performance.md §11), whose peak is the reference, measured the same
way: the live tensors' peak from the allocator's records (`torch.profiler`, deterministic), and the
process's resident memory (`PeakMemory`) where the margin is large."""

from __future__ import annotations

import math

import os
import sys

import pytest
import torch

import torch.nn.functional as F

from aniso_plugins import agg_gates, fused_linear_cross_entropy
from aniso_plugins.methods.fused_loss.passes import plan_tiles

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from measure import PeakMemory

MIB = 2**20


def test_fused_cross_entropy_holds_one_tile_beyond_its_gradients():
    """N = 262144, d = 64 (X, dX: 64 MiB each), V = 1024 (the default tile: 1024 rows, 4 MiB). The op
    used to gather X into a row-ordered copy, keep dX in a second buffer and form the target
    correction over all rows at once: (N, d) temporaries beyond dX (peak 185 MiB here, then 73)."""
    n, v, d = 262144, 1024, 64
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g).requires_grad_(True)
    w = (0.02 * torch.randn(v, d, generator=g)).requires_grad_(True)
    y = torch.randint(0, v, (n,), generator=g)
    y[::7] = -100
    gates = agg_gates(torch.linspace(0.0, 1.0, v), 0.3)  # ids below 0.3 are rare: both row groups
    assert gates.rare.any() and not gates.rare.all()
    fused_linear_cross_entropy(x[:4096], w, y[:4096], gates).backward()  # warm-up
    x.grad = w.grad = None
    with PeakMemory(torch.device("cpu")) as peak:
        fused_linear_cross_entropy(x, w, y, gates).backward()
    assert torch.isfinite(x.grad).all() and x.grad[::7].abs().max() == 0  # ignored rows: no gradient
    outputs = x.grad.numel() * 4 + w.grad.numel() * 4
    assert peak.bytes < outputs + 32 * MIB, (peak.bytes / MIB, outputs / MIB)


def _live_peak(step) -> int:
    """The peak of the bytes held by tensors allocated during `step()` (the CPU allocator's
    records under `torch.profiler`), whatever the process held before."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    records = sorted((r for r in prof.profiler.kineto_results.events() if r.name() == "[memory]"), key=lambda r: r.start_ns())
    live = peak = 0
    for r in records:
        live += r.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("n, v, d", [(4096, 32768, 256), (8192, 8192, 256)], ids=["vocabulary_blocks", "row_chunks"])
def test_the_default_peak_is_at_pytorchs_floor(n, v, d):
    """By default the fused AGG loss holds at most what PyTorch's chunked op holds for plain CE
    (dW + dX + a chunk of about N·d logits), here with every row in tiles of 176 ids (4096 × 32768,
    PyTorch: 32 rows × 32768) and in PyTorch's chunks of 256 whole rows (8192 × 8192): beyond the
    gradients, its chunk, a work block of a 64th of it and 64 bytes per row."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g).requires_grad_(True)
    w = (0.02 * torch.randn(v, d, generator=g)).requires_grad_(True)
    y = torch.randint(0, v, (n,), generator=g)
    gates = agg_gates(torch.linspace(0.0, 1.0, v), 0.3)
    ours = _live_peak(lambda: fused_linear_cross_entropy(x, w, y, gates).backward())
    x.grad = w.grad = None
    theirs = _live_peak(lambda: F.linear_cross_entropy(x, w, y, options=torch.nn.LinearCrossEntropyOptions()).backward())
    floor = (v * d + n * d) * 4
    plan = plan_tiles(n, v, d)
    assert (plan.rows == n) == (n == 4096)  # the two kinds of tiles
    assert floor < ours <= theirs, (ours / MIB, theirs / MIB, floor / MIB)
    chunk = 4 * v * 2 ** math.ceil(math.log2(math.ceil(n / math.ceil(v / d))))  # PyTorch's rows of float32 logits
    assert ours <= floor + chunk + chunk // 64 + 64 * n, (ours / MIB, floor / MIB, chunk / MIB)


def test_large_vocabulary_peak_is_gradients_plus_one_small_tile():
    """V = 524288: 1024 rows of float32 logits are 2 GiB; the default tiles (every row × 176 ids) take
    1.4 MiB, and an explicit chunk_size (whole rows) is honoured."""
    n, v, d = 2048, 2**19, 16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g).requires_grad_(True)
    w = (0.02 * torch.randn(v, d, generator=g)).requires_grad_(True)
    y = torch.randint(0, v, (n,), generator=g)
    gates = agg_gates(torch.linspace(0.0, 1.0, v), 0.3)
    peaks = {}
    for chunk in (None, 1024):
        fused_linear_cross_entropy(x[:64], w, y[:64], gates, chunk_size=chunk).backward()  # warm-up
        x.grad = w.grad = None
        with PeakMemory(torch.device("cpu")) as peak:
            fused_linear_cross_entropy(x, w, y, gates, chunk_size=chunk).backward()
        peaks[chunk] = peak.bytes
        outputs = x.grad.numel() * 4 + w.grad.numel() * 4
        x.grad = w.grad = None
    assert plan_tiles(n, v, d)[:2] == (n, 176)
    assert peaks[None] < outputs + 32 * MIB, peaks
    assert peaks[1024] > outputs + 2000 * MIB, peaks


def test_bf16_cpu_step_holds_no_vocabulary_sized_product():
    """Under CPU bf16 autocast the op holds dW (float32), a bf16 copy of W and one chunk; each
    chunk's dW product used to be a full V × d bf16 buffer (32 MiB here) and is now computed in
    blocks of 512 rows of dW (docs/performance.md §7.3). V = 65536, d = 256, 64-row chunks
    (8 MiB of bf16 logits, an 8 MiB float32 stage): 21 MiB beyond those, 54 before."""
    n, v, d = 512, 65536, 256
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g).requires_grad_(True)
    w = (0.02 * torch.randn(v, d, generator=g)).requires_grad_(True)
    y = torch.randint(0, v, (n,), generator=g)
    gates = agg_gates(torch.linspace(0.0, 1.0, v), 0.3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused_linear_cross_entropy(x[:64], w, y[:64], gates, chunk_size=64).backward()  # warm-up
    x.grad = w.grad = None
    with PeakMemory(torch.device("cpu")) as peak, torch.autocast("cpu", dtype=torch.bfloat16):
        fused_linear_cross_entropy(x, w, y, gates, chunk_size=64).backward()
    assert w.grad.dtype == torch.float32 and torch.isfinite(w.grad).all()
    outputs = x.grad.numel() * 4 + w.grad.numel() * 4
    weight_copy = v * d * 2
    assert peak.bytes < outputs + weight_copy + 32 * MIB, ((peak.bytes - outputs - weight_copy) / MIB)
