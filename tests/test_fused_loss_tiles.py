"""`fused_linear_cross_entropy` over every tiling of the logits (row chunks that hold the whole
vocabulary, vocabulary blocks over all rows, both at once, a partial last block, one id per tile)
against independent float64 references: ``F.cross_entropy`` of the explicit logits (its
``weight=``, ``label_smoothing=``), the z-loss λ·logsumexp(z)² written out, the official
three-logit AGG construction (test_agg.py) for the gated weight gradient, and autograd through
them. Also the default plan of tiles against its formula."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from aniso_plugins import LogitTransform, RowGates, agg_gates, fused_linear_cross_entropy
from aniso_plugins.methods.fused_loss.passes import FLOOR_ROWS, plan_tiles
from test_agg import CASES, IGN, make_case, rel_err, three_logit_loss

V, D, N = 23, 6, 37
TILINGS = {  # (chunk_size, vocab_chunk_size)
    "one_tile": (None, None),
    "row_chunks": (7, None),
    "vocab_blocks": (None, 5),  # 5 + 5 + 5 + 5 + 3: a partial last block
    "rows_and_blocks": (7, 5),
    "one_id_per_tile": (1, 1),
}


def _data(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, dtype=dtype, generator=g, requires_grad=True)
    w = (torch.randn(V, D, dtype=dtype, generator=g) * 0.8).requires_grad_()
    b = torch.randn(V, dtype=dtype, generator=g, requires_grad=True)
    y = torch.randint(0, V, (N,), generator=g)
    y[:5] = IGN
    c = torch.rand(V, dtype=dtype, generator=g) + 0.5
    t = torch.rand(N, dtype=dtype, generator=g)
    return h, w, b, y, c, t


def _reference(h, w, b, y, *, smoothing=0.0, classes=None, tokens=None, z_loss=0.0, transform=None, reduction="mean"):
    """F.cross_entropy of the float64 logits (transformed: written out), times the token weights,
    plus λ·lse² per valid row; divided by Σ c_{y_i} (mean)."""
    z = F.linear(h, w, b)
    if transform is not None:
        z = torch.tanh(z * transform.scale / transform.softcap) * transform.softcap
    valid = y != IGN
    rows = F.cross_entropy(z, y, weight=classes, label_smoothing=smoothing, reduction="none")
    rows = rows + z_loss * torch.logsumexp(z, 1).square() * valid
    rows = rows if tokens is None else rows * tokens
    if reduction == "none":
        return rows
    return rows.sum() / ((valid.sum() if classes is None else classes[y[valid]].sum()) if reduction == "mean" else 1.0)


OPTIONS = {
    "plain": {},
    "smoothing": dict(smoothing=0.15),
    "everything": dict(smoothing=0.1, classes=True, tokens=True, z_loss=1e-2, transform=LogitTransform(0.7, 4.0)),
    "sum_classes": dict(smoothing=0.2, classes=True, reduction="sum"),
    "none_tokens_z": dict(tokens=True, z_loss=1e-2, transform=LogitTransform(0.7, 4.0), reduction="none"),
}


@pytest.mark.parametrize("tiling", list(TILINGS))
@pytest.mark.parametrize("option", list(OPTIONS))
def test_every_tiling_and_option_equals_float64_cross_entropy(tiling, option):
    h, w, b, y, c, t = _data()
    kw = dict(OPTIONS[option])
    kw["classes"] = c if kw.get("classes") else None
    kw["tokens"] = t if kw.get("tokens") else None
    rows, cols = TILINGS[tiling]
    got = fused_linear_cross_entropy(h, w, y, bias=b, chunk_size=rows, vocab_chunk_size=cols,
                                     label_smoothing=kw.get("smoothing", 0.0), class_weights=kw["classes"],
                                     token_weights=kw["tokens"], z_loss=kw.get("z_loss", 0.0),
                                     logit_transform=kw.get("transform"), reduction=kw.get("reduction", "mean"))
    ref = _reference(h, w, b, y, **kw)
    upstream = torch.linspace(0.5, 2.0, N, dtype=torch.float64) if kw.get("reduction") == "none" else 1.0
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-14)
    for a, r in zip(torch.autograd.grad((got * upstream).sum(), (h, w, b)),
                    torch.autograd.grad((ref * upstream).sum(), (h, w, b))):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("case", ["mixed", "rare_majority", "all_rare", "no_rare_targets", "no_rare_ids", "many_rows"])
@pytest.mark.parametrize("tiling", ["vocab_blocks", "rows_and_blocks", "row_chunks"])
@pytest.mark.parametrize("ablation", [{}, {"parts": ("a", "b", "c")}])
def test_vocabulary_blocks_with_agg_gates_equal_the_three_logit_reference(case, tiling, ablation):
    """AGG's gated dW in tiles of part of the vocabulary (Γ applied to each tile, its target
    entries where the tile holds the target), against the official construction in float64."""
    h, W, b, y, a = make_case(dtype=torch.float64, **CASES[case])
    gates = agg_gates(a, 0.3, **ablation)
    for x in (h, W):
        x.requires_grad_(True)
    ref = torch.autograd.grad(three_logit_loss(h, W, y, gates), (h, W))
    rows, cols = TILINGS[tiling]
    loss = fused_linear_cross_entropy(h, W, y, gates, chunk_size=rows, vocab_chunk_size=cols)
    plain = F.cross_entropy(F.linear(h, W).reshape(-1, W.shape[0]), y.reshape(-1), ignore_index=IGN)
    torch.testing.assert_close(loss, plain, rtol=1e-12, atol=0)  # the value is plain CE, not the official 2×
    for g, r in zip(torch.autograd.grad(loss, (h, W)), ref):
        assert rel_err(g, r) < 1e-12


@pytest.mark.parametrize("tiling", list(TILINGS))
def test_all_rows_ignored_gives_zero_loss_and_gradients(tiling):
    h, w, b, y, _, _ = _data(1)
    y = torch.full_like(y, IGN)
    rare = torch.zeros(V, dtype=torch.bool)
    rare[:5] = True
    gates = RowGates(torch.rand(V), torch.rand(V), rare)
    rows, cols = TILINGS[tiling]
    loss = fused_linear_cross_entropy(h, w, y, gates, bias=b, chunk_size=rows, vocab_chunk_size=cols, label_smoothing=0.1)
    grads = torch.autograd.grad(loss, (h, w, b))
    assert float(loss.detach()) == 0.0 and all(not g.any() for g in grads)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_float32_rows_far_below_their_maximum_in_vocabulary_blocks(smoothing):
    """A target hundreds of nats below its row's maximum: in float32 its probability underflows;
    the loss is lse − z_y from the combined log-sum-exp, equal to float64."""
    g = torch.Generator().manual_seed(3)
    v, d = 40, 8
    h = torch.randn(48, d, generator=g)
    w = torch.randn(v, d, generator=g)
    y = torch.randint(0, v, (48,), generator=g)
    for i in (0, 5, 33):
        h[i] = -60.0 * w[y[i]] / w[y[i]].norm() ** 2
    ref = F.cross_entropy(h.double() @ w.double().T, y, label_smoothing=smoothing)
    assert float(ref) * 48 > 3 * 200  # the three rows really are hundreds of nats
    for rows, cols in ((None, 7), (5, None), (5, 7)):
        got = fused_linear_cross_entropy(h, w, y, label_smoothing=smoothing, chunk_size=rows, vocab_chunk_size=cols)
        assert torch.isfinite(got) and abs(float(got) - float(ref)) < 1e-5 * float(ref)


def test_bf16_autocast_in_vocabulary_blocks_matches_float64_within_bf16_rounding():
    """bf16 GEMMs, float32 statistics and gradients per tile (the CPU's staged bf16 logits), dX
    accumulated over the blocks in float32: within bf16 rounding of the float64 loss and gradients."""
    h, w, b, y, c, t = _data(2, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused_linear_cross_entropy(h, w, y, bias=b, vocab_chunk_size=5, label_smoothing=0.1, z_loss=1e-3)
    grads = torch.autograd.grad(got, (h, w, b))
    hd, wd, bd = (x.detach().double().requires_grad_() for x in (h, w, b))
    ref = _reference(hd, wd, bd, y, smoothing=0.1, z_loss=1e-3)
    assert got.dtype == torch.float32 and abs(float(got) - float(ref)) < 2e-2 * float(ref)
    for a, r in zip(grads, torch.autograd.grad(ref, (hd, wd, bd))):
        assert float((a.double() - r).norm() / r.norm()) < 2e-2


CELLS = [(4096, 32768, 768), (4096, 131072, 768), (16384, 32768, 768), (4096, 32768, 2048), (1024, 262144, 512),
         (4096, 50257, 256), (65536, 32768, 768), (20, 13, 6)]


@pytest.mark.parametrize("n, v, d", CELLS)
@pytest.mark.parametrize("itemsize", [4, 2])
def test_the_default_tiles_take_pytorchs_chunk(n, v, d, itemsize):
    """The default plan, from PyTorch's chunk (next_pow2(⌈N/⌈V/d⌉⌉) rows of float32 logits, written
    out here): whole rows (at most 1024) where at least FLOOR_ROWS of them fit in the chunk's bytes
    (at least 1 MiB), with work blocks of a 64th of the chunk, else every row and the ids that fit
    in the chunk less two work blocks (an eighth of it, at most 4 MiB) and 64 bytes per row."""
    target = math.ceil(n / math.ceil(v / d))
    chunk = 4 * v * min(2 ** math.ceil(math.log2(target)), n)
    block = min(4 * 2**20, max(chunk // 8, 2**18))
    plan = plan_tiles(n, v, d, itemsize=itemsize)
    fit = max(chunk, 2**20) // (itemsize * v)
    if fit >= min(n, FLOOR_ROWS):
        assert (plan.rows, plan.cols, plan.block) == (min(fit, 1024, n), v, min(block, max(chunk // 64, 4096)))
        assert plan.rows * plan.cols * itemsize <= max(chunk, 2**20)
    else:
        budget = max(chunk - 2 * block - 64 * n, 2**20) // itemsize
        assert (plan.rows, plan.cols, plan.block) == (n, budget // n, block)
    assert plan_tiles(n, v, d, rows=512)[:2] == (min(512, n), v) and plan_tiles(n, v, d, cols=100)[:2] == (n, min(100, v))


def test_the_default_tiles_of_the_benchmark_cells():
    """The plans written out (docs/performance.md §11.4): PyTorch's chunk rows there are 128, 512,
    256, 32, 2 and 2048; fewer than 64 rows give vocabulary blocks."""
    expected = {(4096, 32768, 768): (128, 32768), (4096, 50304, 768): (64, 50304),
                (16384, 32768, 768): (512, 32768), (4096, 32768, 2048): (256, 32768),
                (4096, 131072, 768): (4096, 752), (4096, 50257, 256): (4096, 278),
                (1024, 262144, 512): (1024, 368), (65536, 32768, 768): (1024, 32768)}
    assert {cell: tuple(plan_tiles(*cell)[:2]) for cell in expected} == expected


def test_tile_sizes_are_checked_with_the_value_and_the_fix():
    h, w, b, y, _, _ = _data()
    with pytest.raises(ValueError, match=r"vocab_chunk_size=0: expected an integer >= 1 \(vocabulary ids per tile\)"):
        fused_linear_cross_entropy(h, w, y, vocab_chunk_size=0)
    with pytest.raises(ValueError, match=r"chunk_size=2.5: expected an integer >= 1 \(token rows per tile\)"):
        fused_linear_cross_entropy(h, w, y, chunk_size=2.5)


def test_a_few_whole_rows_are_computed_ids_major_on_the_cpu():
    """A float32 tile of at most TRANSPOSED_ROWS whole rows holds its logits ids-major (W Xᵀ, the
    faster GEMM for a few rows here) and is read as rows × ids: equal to X Wᵀ + b written out; the
    default plan at 4096 × 50304, d = 768 is such a tile (PyTorch's 64 rows)."""
    from aniso_plugins.methods.fused_loss.passes import TRANSPOSED_ROWS
    from aniso_plugins.methods.fused_loss.workspace import Tile

    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 4, generator=g), torch.randn(9, 4, generator=g), torch.randn(9, generator=g)
    z = Tile(5, 9, torch.float32, torch.float32, torch.device("cpu"), 2**12, transposed=True).logits(x, w, b)
    assert z.shape == (5, 9) and z.T.is_contiguous() and not z.is_contiguous()
    expected = [[sum(float(x[i, k]) * float(w[j, k]) for k in range(4)) + float(b[j]) for j in range(9)] for i in range(5)]
    torch.testing.assert_close(z, torch.tensor(expected), rtol=1e-5, atol=1e-5)
    assert plan_tiles(4096, 50304, 768).rows == 64 <= TRANSPOSED_ROWS
