"""Peak memory of `fused_linear_cross_entropy`: one logits chunk beyond its outputs (dX, dW), no (N, d)
copies of the hidden states (docs/performance.md §7.3)."""

from __future__ import annotations

import os
import sys

import torch

from aniso_plugins import fused_linear_cross_entropy, agg_gates
from aniso_plugins.methods.fused_loss.cross_entropy import default_chunk_rows

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from measure import PeakMemory

MIB = 2**20


def test_fused_cross_entropy_holds_one_chunk_beyond_its_gradients():
    """N = 262144, d = 64 (X, dX: 64 MiB each), V = 1024 (a 1024-row chunk: 4 MiB). The op used
    to gather X into a row-ordered copy, keep dX in a second buffer and form the target
    correction over all rows at once: (N, d) temporaries beyond dX (peak 185 MiB here, now 73)."""
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


def test_default_chunk_rows_an_eighth_of_the_batch_and_at_most_512_mib_of_logits():
    expected = {1000: 1024, 131072: 1024, 131073: 1023, 262144: 512, 2**19: 256, 2**20: 256}
    assert {v: default_chunk_rows(v, 65536) for v in expected} == expected
    by_tokens = {100: 512, 4096: 512, 6000: 750, 8192: 1024, 10**6: 1024}
    assert {n: default_chunk_rows(32768, n) for n in by_tokens} == by_tokens
    assert default_chunk_rows(262144, 4096) == 512 and default_chunk_rows(2**19, 100) == 256
    bf16 = {100: 512, 2048: 512, 4096: 1024, 10**6: 1024}  # bf16 logits: twice the rows for the bytes
    assert {n: default_chunk_rows(32768, n, logit_bytes=2) for n in bf16} == bf16
    assert default_chunk_rows(2**19, 10**6, logit_bytes=2) == 512


def test_large_vocabulary_peak_is_gradients_plus_one_capped_chunk():
    """V = 524288: 1024 rows of float32 logits are 2 GiB; the default chunk (256 rows) is 512 MiB,
    and an explicit chunk_size is honoured."""
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
    assert peaks[None] < outputs + 576 * MIB, peaks
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
