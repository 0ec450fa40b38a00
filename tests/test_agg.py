"""AGG gates, gated_linear, the fused AGG cross-entropy and the AGG plugin, against references
written out here: the official three-logit construction (``cross_entropy_agg.py``,
docs/methods.md §1.4), the gate formulas in float64, the per-part gradient decomposition of
docs/methods.md §0, plain cross-entropy, and an explicit dense counter."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from aniso_plugins import (
    RowGates,
    TrainingHead,
    AnisoConfig,
    AnisoPlugins,
    ConfigError,
    LowRankHead,
    ModelHandle,
    RunInfo,
    SetupError,
    StepInfo,
    fused_linear_cross_entropy,
    agg_gates,
    gated_linear,
)
from aniso_plugins.methods.fused_loss import gemm as gemm_ops
from test_counter import DenseRing

IGN = -100


# --- references -------------------------------------------------------------------------------


def ref_gates(a: torch.Tensor, alpha: float, steps: int = 1):
    """Gate formulas of docs/methods.md §1.2-1.3 in float64 loops, with the official count-space guard."""
    a64 = [float(x) for x in a.to(torch.float32)]
    rare = [x < float(torch.tensor(alpha, dtype=torch.float32)) for x in a64]  # the code compares in float32
    counts = [x * steps for x in a64]
    rare_counts = [c for c, r in zip(counts, rare) if r]
    mean_c = sum(rare_counts) / len(rare_counts) if rare_counts else math.nan
    g1 = [x if r else 1.0 for x, r in zip(a64, rare)]
    g2 = [min(c / (mean_c + 1e-7), 1.0) if r else 1.0 for c, r in zip(counts, rare)]
    return torch.tensor(g1, dtype=torch.float64), torch.tensor(g2, dtype=torch.float64), torch.tensor(rare)


def three_logit_loss(h, W, y, gates: RowGates, bias=None, smoothing=0.0):
    """The official AGG loss: z0 = sg(W)h (to h only), z1/z2 = gated stop-gradient logits to W
    only, for non-rare / rare target rows; NLLs summed over the non-ignored rows / ntokens.
    Target entries get gate 1 (or g_target when given). Rows with ignore_index are dropped."""
    V = W.shape[0]
    h = h.reshape(-1, h.shape[-1])
    y = y.reshape(-1)
    valid = y != IGN
    h, y = h[valid], y[valid]
    b_det = None if bias is None else bias.detach()
    z0 = F.linear(h, W.detach(), bias)
    loss = F.cross_entropy(z0, y, reduction="sum", label_smoothing=smoothing)
    rare_t = gates.rare[y]
    for rows, g in ((~rare_t, gates.g1), (rare_t, gates.g2)):
        if not rows.any():
            continue
        n = int(rows.sum())
        gate = g.to(h.dtype).expand(n, V).clone()
        tgt = torch.ones(n, dtype=h.dtype) if gates.g_target is None else gates.g_target.to(h.dtype)[y[rows]]
        gate[torch.arange(n), y[rows]] = tgt
        z = F.linear(h[rows].detach(), W, b_det)
        z = gate * z + (1 - gate) * z.detach()
        loss = loss + F.cross_entropy(z, y[rows], reduction="sum", label_smoothing=smoothing)
    return loss / valid.sum()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


def make_case(n=48, v=19, d=6, dtype=torch.float64, rare_ids=(2, 5, 7, 11), rare_share=0.3, seed=0, shape=None):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=dtype)
    W = torch.randn(v, d, generator=g, dtype=dtype)
    b = torch.randn(v, generator=g, dtype=dtype)
    a = torch.rand(v, generator=g) * 0.5 + 0.5  # frequent: a >= 0.5
    a[list(rare_ids)] = torch.tensor([0.0, 0.05, 0.1, 0.2][: len(rare_ids)] + [0.15] * (len(rare_ids) - 4))
    rare = torch.tensor(rare_ids)
    frequent = torch.tensor([k for k in range(v) if k not in rare_ids])
    pick_rare = torch.rand(n, generator=g) < rare_share
    y = torch.where(
        pick_rare,
        rare[torch.randint(len(rare), (n,), generator=g)] if len(rare) else 0,
        frequent[torch.randint(len(frequent), (n,), generator=g)],
    )
    y[torch.rand(n, generator=g) < 0.15] = IGN
    if shape is not None:
        h, y = h.reshape(*shape, d), y.reshape(shape)
    return h, W, b, y, a


# --- gates --------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [1, 7])
def test_gates_match_the_official_formulas(steps):
    g = torch.Generator().manual_seed(1)
    counts = torch.randint(0, 6, (40,), generator=g).float()
    a = counts / steps
    a[[0, 1]] = 1.0  # specials
    alpha = 0.5
    gates = agg_gates(a, alpha, steps=steps)
    g1, g2, rare = ref_gates(a, alpha, steps)
    assert torch.equal(gates.rare, rare) and gates.g_target is None
    torch.testing.assert_close(gates.g1.double(), g1, rtol=1e-6, atol=0)
    torch.testing.assert_close(gates.g2.double(), g2, rtol=1e-6, atol=0)
    assert gates.g1.dtype == gates.g2.dtype == torch.float32


def test_rare_is_strict_and_edge_groups():
    a = torch.tensor([0.25, 0.125, 0.5, 0.0])
    gates = agg_gates(a, 0.25)
    assert gates.rare.tolist() == [False, True, False, True]  # a == alpha is not rare
    # g2 on the rare group: a / mean(a_r) = 0.125 / 0.0625 -> clipped to 1, 0 / 0.0625 = 0
    assert gates.g2.tolist() == [1.0, 1.0, 1.0, 0.0]
    empty = agg_gates(torch.ones(5), 0.5)
    assert not empty.rare.any() and torch.equal(empty.g1, torch.ones(5)) and torch.equal(empty.g2, torch.ones(5))
    zero_mean = agg_gates(torch.tensor([0.0, 0.0, 1.0]), 0.5)  # rare ids never seen: c̄_r = 0
    assert zero_mean.g2.tolist() == [0.0, 0.0, 1.0] and zero_mean.g1.tolist() == [0.0, 0.0, 1.0]


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"appearance": torch.zeros(2, 2), "alpha": 0.1}, ValueError, ["appearance", "(V,)"]),
        ({"appearance": torch.zeros(3), "alpha": 0.0}, ValueError, ["alpha=0.0"]),
        ({"appearance": torch.zeros(3), "alpha": 0.1, "steps": 0}, ValueError, ["steps=0"]),
        ({"appearance": torch.zeros(3), "alpha": 0.1, "parts": ("b", "x")}, ValueError, ["parts", "'x'"]),
    ],
)
def test_gate_errors(kwargs, error, words):
    with pytest.raises(error) as e:
        agg_gates(**kwargs)
    for w in words:
        assert w in str(e.value)


# --- gated_linear against the three-logit construction ---------------------------------------------


CASES = {
    "few_rare": dict(rare_share=0.1),
    "mixed": dict(rare_share=0.3),
    "rare_majority": dict(rare_share=0.8),
    "all_rare": dict(rare_share=1.0),
    "no_rare_targets": dict(rare_share=0.0),
    "no_rare_ids": dict(rare_ids=()),
    "3d": dict(shape=(4, 12)),
    "many_rows": dict(n=1200, rare_share=0.45),  # two blocks of rows in gated_linear's backward (1024 + 176)
    "many_rows_few_rare": dict(n=3000, rare_share=0.12),  # three blocks, the last one partial
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gated_linear_equals_three_logit_reference(case, dtype, tol, with_bias):
    h, W, b, y, a = make_case(dtype=dtype, **CASES[case])
    gates = agg_gates(a, 0.3)
    rare_rows = float(((y != IGN) & gates.rare[y.clamp_min(0)]).float().mean())
    if case.endswith("few_rare"):
        assert rare_rows < 0.2
    elif case in ("mixed", "many_rows"):
        assert 0.2 < rare_rows < 0.5
    h.requires_grad_(True)
    W.requires_grad_(True)
    b = b.requires_grad_(True) if with_bias else None
    params = (h, W) + ((b,) if with_bias else ())

    ref = grads(three_logit_loss(h, W, y, gates, b), *params)
    logits = gated_linear(h, W, y, gates, bias=b, ignore_index=IGN)
    loss = F.cross_entropy(logits.reshape(-1, W.shape[0]), y.reshape(-1), ignore_index=IGN)
    got = grads(loss, *params)
    for r, g in zip(ref, got):
        assert g.dtype == dtype
        assert rel_err(g, r) < tol
    # the value is plain CE (the official loss is twice that)
    plain = F.cross_entropy(F.linear(h, W, b).reshape(-1, W.shape[0]), y.reshape(-1), ignore_index=IGN)
    torch.testing.assert_close(loss, plain)


def test_label_smoothing_matches_the_official_mt_loss():
    """MT (docs/methods.md §1.4): each of the three terms is (1-ε)·NLL + ε/V·Σ_k(-log p_k) on its own
    logits; gated_linear + smoothed CE has the same gradients."""
    h, W, _, y, a = make_case(dtype=torch.float64)
    gates = agg_gates(a, 0.3)
    h.requires_grad_(True)
    W.requires_grad_(True)
    ref = grads(three_logit_loss(h, W, y, gates, smoothing=0.1), h, W)
    got = grads(F.cross_entropy(gated_linear(h, W, y, gates), y, ignore_index=IGN, label_smoothing=0.1), h, W)
    for g, r in zip(got, ref):
        assert rel_err(g, r) < 1e-12


def test_all_gates_one_is_plain_cross_entropy():
    h, W, b, y, _ = make_case(dtype=torch.float32)
    v = W.shape[0]
    rare = torch.zeros(v, dtype=torch.bool)
    rare[[2, 5, 7]] = True  # rare rows exist, but every gate is 1
    gates = RowGates(torch.ones(v), torch.ones(v), rare)
    h.requires_grad_(True)
    W.requires_grad_(True)
    b.requires_grad_(True)
    got = grads(F.cross_entropy(gated_linear(h, W, y, gates, bias=b), y), h, W, b)
    ref = grads(F.cross_entropy(F.linear(h, W, b), y), h, W, b)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)


def softmax_rows(h, W, y):
    """The non-ignored rows in float64: softmax p, hidden x, targets t, and their count."""
    valid = y != IGN
    h, y = h[valid].double(), y[valid]
    p = torch.softmax(h @ W.double().T, dim=1)
    return p, h, y, valid.sum()


@pytest.mark.parametrize(
    "ablation",
    [
        {},
        {"g1": False},
        {"g2": False},
        {"parts": ("b",)},
        {"parts": ("c",)},
        {"parts": ("a", "b", "c")},
        {"parts": ()},
        {"freeze_rare": True},
    ],
)
def test_ablations_gate_exactly_their_parts(ablation):
    h, W, _, y, a = make_case(n=80, dtype=torch.float64, rare_share=0.4, seed=3)
    alpha = 0.3
    gates = agg_gates(a, alpha, **ablation)
    Wp = W.clone().requires_grad_(True)
    hp = h.clone().requires_grad_(True)
    dh, dW = grads(F.cross_entropy(gated_linear(hp, Wp, y, gates), y, ignore_index=IGN), hp, Wp)

    p, x, t, n = softmax_rows(h, W, y)
    a64 = a.double()
    rare = a64 < alpha
    mean_rare = a64[rare].mean()
    parts = ablation.get("parts", ("b", "c"))
    ones = torch.ones_like(a64)
    g1 = a64 if ablation.get("g1", True) and "b" in parts else ones
    g2 = (a64 / (mean_rare + 1e-7)).clamp(max=1) if ablation.get("g2", True) and "c" in parts else ones
    ga = a64 if "a" in parts else ones
    if ablation.get("freeze_rare"):
        g1, g2, ga = torch.zeros_like(a64), torch.zeros_like(a64), torch.zeros_like(a64)
    expected = torch.zeros_like(W)
    for k in range(W.shape[0]):
        own = t == k
        part_a = ((p[own, k] - 1)[:, None] * x[own]).sum(0)
        if not rare[k]:
            expected[k] = part_a + (p[~own, k][:, None] * x[~own]).sum(0)
            continue
        b_rows = ~rare[t]
        c_rows = rare[t] & ~own
        part_b = (p[b_rows, k][:, None] * x[b_rows]).sum(0)
        part_c = (p[c_rows, k][:, None] * x[c_rows]).sum(0)
        expected[k] = ga[k] * part_a + g1[k] * part_b + g2[k] * part_c
    assert rel_err(dW, expected / n) < 1e-6  # the gates themselves are float32
    # ∂L/∂h is plain CE whatever the gates
    onehot = F.one_hot(t, W.shape[0]).double()
    dh_plain = torch.zeros_like(h)
    dh_plain[y != IGN] = (p - onehot) @ W / n
    assert rel_err(dh, dh_plain) < 1e-12


def test_gate_zero_on_a_rare_row_with_non_rare_targets():
    """docs/methods.md §11: gate 0 on rare id r, all targets non-rare => dW_r = 0; target rows keep (p-1)h."""
    h, W, _, y, a = make_case(n=30, dtype=torch.float64, rare_share=0.0, seed=4)
    a[2] = 0.0
    gates = agg_gates(a, 0.3)
    assert gates.g1[2] == 0
    Wp = W.clone().requires_grad_(True)
    (dW,) = grads(F.cross_entropy(gated_linear(h, Wp, y, gates), y, ignore_index=IGN), Wp)
    assert torch.count_nonzero(dW[2]) == 0
    Wq = W.clone().requires_grad_(True)
    (dW_plain,) = grads(F.cross_entropy(F.linear(h, Wq), y, ignore_index=IGN), Wq)
    targets = y[y != IGN].unique()
    torch.testing.assert_close(dW[targets], dW_plain[targets], rtol=1e-12, atol=1e-14)


class TiedLM(nn.Module):
    def __init__(self, vocab=19, dim=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def body(self, ids):
        return torch.tanh(self.block(self.embed(ids)))

    def forward(self, ids):
        return self.lm_head(self.body(ids))


def test_tied_embedding_gates_only_the_output_side():
    torch.manual_seed(5)
    model = TiedLM().double()
    _, _, _, y, a = make_case(n=40, rare_share=0.4, seed=5)
    ids = torch.randint(0, 19, (40,))
    gates = agg_gates(a, 0.3)
    params = list(model.parameters())  # embed/head weight once, block weight, block bias
    logits = gated_linear(model.body(ids), model.lm_head.weight, y, gates)
    got = grads(F.cross_entropy(logits, y, ignore_index=IGN), *params)
    ref = grads(three_logit_loss(model.body(ids), model.lm_head.weight, y, gates), *params)
    for g, r in zip(got, ref):
        assert rel_err(g, r) < 1e-12
    # the input-lookup part of the tied gradient is ungated: removing it leaves the gated head part
    h, w = model.body(ids), model.lm_head.weight
    (head_only,) = grads(F.cross_entropy(gated_linear(h.detach(), w, y, gates), y, ignore_index=IGN), w)
    (lookup_only,) = grads(F.cross_entropy(F.linear(h, w.detach()), y, ignore_index=IGN), w)
    assert rel_err(got[0], head_only + lookup_only) < 1e-12


def test_gated_linear_input_errors():
    h, W, _, y, a = make_case(dtype=torch.float32)
    gates = agg_gates(a, 0.3)
    with pytest.raises(ValueError, match="targets of shape"):
        gated_linear(h, W, y[:-1], gates)
    with pytest.raises(RuntimeError, match=r"targets must be in \[0, 19\)"):  # checked on the device
        gated_linear(h, W, torch.full_like(y, 19), gates)
    with pytest.raises(ValueError, match="gates are for 3 ids"):
        gated_linear(h, W, y, agg_gates(torch.ones(3), 0.1))
    with pytest.raises(ValueError, match="features"):
        gated_linear(h[:, :-1], W, y, gates)
    with pytest.raises(TypeError, match="integer"):
        gated_linear(h, W, y.float(), gates)


# --- fused AGG cross-entropy -----------------------------------------------------------------------


@pytest.mark.parametrize("case", ["mixed", "rare_majority", "all_rare", "3d", "many_rows"])
@pytest.mark.parametrize("chunk", [1, 5, 1000])
@pytest.mark.parametrize("ablation", [{}, {"parts": ("a", "b", "c")}, {"freeze_rare": True}])
def test_fused_equals_gated_linear_plus_ce(case, chunk, ablation):
    h, W, b, y, a = make_case(dtype=torch.float64, **CASES[case])
    gates = agg_gates(a, 0.3, **ablation)
    for t in (h, W, b):
        t.requires_grad_(True)
    logits = gated_linear(h, W, y, gates, bias=b)
    ref_loss = F.cross_entropy(logits.reshape(-1, W.shape[0]), y.reshape(-1), ignore_index=IGN)
    ref = grads(ref_loss, h, W, b)
    loss = fused_linear_cross_entropy(h, W, y, gates, bias=b, chunk_size=chunk)
    got = grads(loss, h, W, b)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and rel_err(g, r) < 1e-12


def test_fused_sum_with_normalizer_and_upstream_scale():
    h, W, _, y, a = make_case(dtype=torch.float64)
    gates = agg_gates(a, 0.3)
    h.requires_grad_(True)
    W.requires_grad_(True)
    gvt = torch.tensor(1000.0, dtype=torch.float64)  # e.g. torchtitan's global_valid_tokens
    logits = gated_linear(h, W, y, gates)
    ref_loss = 3.0 * F.cross_entropy(logits, y, ignore_index=IGN, reduction="sum") / gvt
    ref = grads(ref_loss, h, W)
    loss = 3.0 * fused_linear_cross_entropy(h, W, y, gates, reduction="sum", normalizer=gvt, chunk_size=7)
    got = grads(loss, h, W)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    for g, r in zip(got, ref):
        assert rel_err(g, r) < 1e-12


def test_fused_without_gates_is_plain_fused_cross_entropy():
    h, W, b, y, _ = make_case(dtype=torch.float32)
    for t in (h, W, b):
        t.requires_grad_(True)
    ref_loss = F.cross_entropy(F.linear(h, W, b), y, ignore_index=IGN)
    ref = grads(ref_loss, h, W, b)
    loss = fused_linear_cross_entropy(h, W, y, bias=b, chunk_size=16)
    got = grads(loss, h, W, b)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for g, r in zip(got, ref):
        assert rel_err(g, r) < 1e-5


def test_fused_all_ignored_gives_zero_and_errors():
    h, W, _, y, a = make_case(dtype=torch.float32)
    h.requires_grad_(True)
    W.requires_grad_(True)
    loss = fused_linear_cross_entropy(h, W, torch.full_like(y, IGN), agg_gates(a, 0.3))
    dh, dW = grads(loss, h, W)
    assert float(loss.detach()) == 0.0 and not dh.any() and not dW.any()
    with pytest.raises(ValueError, match="reduction='bogus'"):
        fused_linear_cross_entropy(h, W, y, reduction="bogus")
    with pytest.raises(ValueError, match="normalizer"):
        fused_linear_cross_entropy(h, W, y, normalizer=3.0)
    with pytest.raises(ValueError, match="chunk_size=0"):
        fused_linear_cross_entropy(h, W, y, chunk_size=0)
    with torch.no_grad():  # validation: loss only
        torch.testing.assert_close(fused_linear_cross_entropy(h, W, y), F.cross_entropy(F.linear(h, W), y, ignore_index=IGN))
    loss = fused_linear_cross_entropy(h, W, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="once"):
        loss.backward()
    loss = fused_linear_cross_entropy(h, W, y, backward_twice=True)
    first = torch.autograd.grad(loss, (h, W), retain_graph=True)
    second = torch.autograd.grad(loss, (h, W), retain_graph=True)  # a zero-bubble pipeline's weight pass
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    with pytest.raises(RuntimeError, match="another output gradient"):
        torch.autograd.grad(2 * loss, (h, W))


# --- bf16 autocast ------------------------------------------------------------------------------------


def test_bf16_autocast_runs_and_is_close_to_fp32():
    h, W, b, y, a = make_case(n=64, v=40, d=16, dtype=torch.float32, rare_ids=(2, 5, 7, 11))
    gates = agg_gates(a, 0.3)
    for t in (h, W, b):
        t.requires_grad_(True)
    ref = grads(F.cross_entropy(gated_linear(h, W, y, gates, bias=b), y, ignore_index=IGN), h, W, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = gated_linear(h, W, y, gates, bias=b)
        assert logits.dtype == torch.float32  # the logit gradient will arrive in float32
        loss = F.cross_entropy(logits, y, ignore_index=IGN)
        fused = fused_linear_cross_entropy(h, W, y, gates, bias=b, chunk_size=16)
    for got in (grads(loss, h, W, b), grads(fused, h, W, b)):
        for g, r, t in zip(got, ref, (h, W, b)):
            assert g.dtype == t.dtype == torch.float32
            assert rel_err(g, r) < 2e-2
    # bf16 parameters without autocast: fp32 accumulation inside, bf16 gradients out
    ref_h, ref_w = grads(F.cross_entropy(gated_linear(h, W, y, gates), y, ignore_index=IGN), h, W)
    Wb, hb = W.detach().bfloat16().requires_grad_(True), h.detach().bfloat16().requires_grad_(True)
    dh, dW = grads(F.cross_entropy(gated_linear(hb, Wb, y, gates).float(), y, ignore_index=IGN), hb, Wb)
    assert dW.dtype == dh.dtype == torch.bfloat16
    assert rel_err(dW, ref_w) < 2e-2 and rel_err(dh, ref_h) < 2e-2


class _MatmulDtypes(TorchDispatchMode):
    """Records the operand dtypes of every matrix product that reaches the dispatcher."""

    PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default,
                torch.ops.aten.mm.out, torch.ops.aten.addmm.out}

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[torch.dtype, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.PRODUCTS:
            self.seen.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor) and a.dim() == 2))
        return func(*args, **(kwargs or {}))


def test_bf16_autocast_every_head_gemm_takes_bf16_operands_as_autograd():
    """Under autocast the weight-gradient GEMM used to multiply float32 operands (the float32
    logit gradient and an upcast X): many times slower than autograd's bf16 GEMM on a GPU.
    Every product now takes bf16 operands, and dW stays as accurate as plain autograd's."""
    h, W, b, y, a = make_case(n=2048, v=512, d=64, dtype=torch.float32, rare_ids=(2, 5, 7, 11, 13, 17))
    gates = agg_gates(a, 0.3)
    W64 = W.double().requires_grad_(True)
    ref_dw = grads(three_logit_loss(h.double(), W64, y, gates), W64)[0]
    W.requires_grad_(True)
    errors = {}
    for name, run in {
        "autograd": lambda: three_logit_loss(h, W, y, gates),
        "gated_linear": lambda: F.cross_entropy(gated_linear(h, W, y, gates), y, ignore_index=IGN),
        "fused": lambda: fused_linear_cross_entropy(h, W, y, gates, chunk_size=256),
        "fused_staged": lambda: _with_stage_rows(7, lambda: fused_linear_cross_entropy(h, W, y, gates, chunk_size=256)),
    }.items():
        mode = _MatmulDtypes()
        with torch.autocast("cpu", dtype=torch.bfloat16), mode:
            dw = grads(run(), W)[0]
        assert mode.seen, name
        if name != "autograd":
            assert all(set(d) == {torch.bfloat16} for d in mode.seen), (name, mode.seen)
        errors[name] = rel_err(dw, ref_dw)
    assert errors["autograd"] < 2e-2
    for name in ("gated_linear", "fused", "fused_staged"):
        assert errors[name] < 2 * errors["autograd"], errors


def _with_stage_rows(rows: int, run):
    """`run()` with the CPU's float32 stage for bf16 logits cut to `rows` rows per block (V = 512),
    so that a chunk takes many blocks and a last, shorter one."""
    from aniso_plugins.methods.fused_loss import workspace

    saved = workspace.STAGE_BYTES
    workspace.STAGE_BYTES = 4 * 512 * rows
    try:
        return run()
    finally:
        workspace.STAGE_BYTES = saved


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_bf16_staged_fused_loss_and_input_gradient_match_float64(smoothing):
    """bf16 autocast on the CPU: the chunk's bf16 logits go through the float32 stage in blocks
    of rows. Loss and dX against float64 cross-entropy of the same bf16-rounded logits."""
    h, W, b, y, a = make_case(n=600, v=512, d=64, dtype=torch.float32, rare_ids=(2, 5, 7))
    hb, Wb = h.bfloat16().double().requires_grad_(True), W.bfloat16().double()
    logits = (hb @ Wb.T).bfloat16().double()  # the GEMM's bf16 output, then float64
    ref = F.cross_entropy(logits, y, ignore_index=IGN, label_smoothing=smoothing)
    (ref_dh,) = torch.autograd.grad(ref, hb)
    x = h.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _with_stage_rows(7, lambda: fused_linear_cross_entropy(x, W, y, agg_gates(a, 0.3), chunk_size=256,
                                                               label_smoothing=smoothing))
    (dh,) = torch.autograd.grad(loss, x)
    assert abs(float(loss) - float(ref)) < 1e-5 * float(ref)
    assert rel_err(dh.double(), ref_dh) < 1e-2


@pytest.mark.parametrize("path", ["device_rows", "blocked"])
def test_rounded_dw_product_paths_add_the_bf16_rounded_product(path):
    """`addmm_in_`'s bf16 paths (off the CPU blocks of rows of at most `PRODUCT_BYTES`, on the CPU
    blocks of `UPCAST_ROWS` rows), both run here: out += round_bf16(A B), against float64 of the
    bf16 operands, rounded once. 1100 rows: two full blocks and a partial one."""
    g = torch.Generator().manual_seed(0)
    v, n, d = 1100, 96, 48
    a, b = torch.randn(v, n, generator=g).bfloat16(), torch.randn(n, d, generator=g).bfloat16()
    out0 = torch.randn(v, d, generator=g)
    product = (a.double() @ b.double()).bfloat16().double()  # the GEMM's one rounding
    ref = out0.double() + product
    out = out0.clone()
    if path == "device_rows":
        gemm_ops._add_rounded_product_in_rows_(out, a, b, 512)
    else:
        assert v > 2 * gemm_ops.UPCAST_ROWS
        gemm_ops._add_rounded_product_blocked_(out, a, b)
    # float32 accumulation inside the GEMM may round a product to the neighbouring bf16 value
    ulp = 2.0 ** -7 * product.abs()
    err = (out.double() - ref).abs()
    assert bool((err <= ulp + 1e-6 * ref.abs() + 1e-6).all()), float((err - ulp).max())
    assert float(err.mean()) < 1e-3 * float(product.abs().mean())  # almost all entries exact


# --- TrainingHead --------------------------------------------------------------------------------------------


def test_head_reads_computed_weight_and_consumes_targets_once():
    h, _, _, y, a = make_case(dtype=torch.float64)
    torch.manual_seed(0)
    head = LowRankHead(6, 19, 3, bias=False, dtype=torch.float64)  # `weight` is computed, W = A·B
    gates = agg_gates(a, 0.3)
    ref = grads(three_logit_loss(h, head.weight, y, gates), head.A, head.B)
    installed = TrainingHead(head)
    installed.arm(y, gates)
    got = grads(F.cross_entropy(head(h), y, ignore_index=IGN), head.A, head.B)
    for g, r in zip(got, ref):
        assert rel_err(g, r) < 1e-12
    assert not installed.armed
    # without targets: the original forward (plain gradient), here also in eval mode / no_grad
    plain = grads(F.cross_entropy(head(h), y, ignore_index=IGN), head.A, head.B)
    expected = grads(F.cross_entropy(h @ head.B.T @ head.A.T, y, ignore_index=IGN), head.A, head.B)
    for g, r in zip(plain, expected):
        torch.testing.assert_close(g, r)
    installed.arm(y, gates)
    head.eval()
    head(h)
    with torch.no_grad():
        head.train()
        head(h)
    assert installed.armed  # neither call consumed them
    with pytest.raises(SetupError, match="already has an aniso training forward installed.*detach"):
        TrainingHead(head)
    installed.remove()
    assert "forward" not in head.__dict__


def test_head_in_chunks_and_fused_give_the_reference_gradient():
    """The two other ways an adapter runs the AGG head: one call per sequence chunk (torchtitan's
    chunked loss) and the fused loss (one call returning Σ CE / normalizer)."""
    g = torch.Generator().manual_seed(4)
    h = torch.randn(2, 8, 6, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, 19, (2, 8), generator=g)
    y[:, -1] = IGN
    head = nn.Linear(6, 19, bias=False).double()
    gates = agg_gates(torch.bincount(y[y != IGN], minlength=19).float() / 16, 0.07)
    assert gates.rare[y[y != IGN]].any() and not gates.rare.all()
    count = int((y != IGN).sum())
    ref = grads(three_logit_loss(h, head.weight, y, gates) * count / 5.0, h, head.weight)  # Σ NLL / 5
    installed = TrainingHead(head, ignore_index=IGN, chunk_size=3)

    installed.arm(y, gates, chunks=4)
    parts = [head(piece) for piece in h.chunk(4, dim=1)]  # four calls, two positions each
    assert not installed.armed
    loss = sum(F.cross_entropy(z.reshape(-1, 19), t.reshape(-1), ignore_index=IGN, reduction="sum")
               for z, t in zip(parts, y.chunk(4, dim=1))) / 5.0
    for got, want in zip(grads(loss, h, head.weight), ref):
        assert rel_err(got, want) < 1e-12

    installed.arm(y, gates)
    installed.fuse(torch.tensor(5.0, dtype=torch.float64))
    fused = head(h)
    assert fused.dim() == 0 and not installed.armed
    for got, want in zip(grads(fused, h, head.weight), ref):
        assert rel_err(got, want) < 1e-12
    installed.disarm()
    with pytest.raises(ValueError, match="arm the micro-batch first"):
        installed.fuse(torch.tensor(5.0))


# --- the plugin, driven as an adapter does --------------------------------------------------------------


def _plugins(**overrides):
    cfg = dict(method="agg", alpha=0.6, window=4, special_ids=(0,), metrics=(), load_entry_points=False)
    cfg.update(overrides)
    return AnisoPlugins(AnisoConfig(**cfg))


def _ready(plugins, model, run=RunInfo(), **handle):
    """Set up on `model` and begin training, as an adapter does."""
    plugins.setup(ModelHandle(model, head="lm_head", **handle))
    plugins.begin_training(run)
    return plugins


def _batches(steps=4, micro=2, seed=7, vocab=19):
    g = torch.Generator().manual_seed(seed)
    probs = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-1.5)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(micro):
            ids = torch.randint(0, vocab, (2, 9), generator=g)
            tgt = torch.multinomial(probs, 18, replacement=True, generator=g).reshape(2, 9)
            tgt[:, -1] = IGN  # the causal shift leaves the last position without a target
            step.append((ids, tgt))
        out.append(step)
    return out


def _reference_run(model, batches, alpha, window, special_ids=(0,), static_after=None):
    """Grads per step from the dense ring + the explicit gate formulas + the three-logit loss:
    every micro-batch of a step gated with the counts of the whole step (all of them counted
    first, as one batch)."""
    ring = DenseRing(19, window, special_ids)
    results, frozen, rare_rows = [], None, 0
    for t, step in enumerate(batches, start=1):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for _, tgt in step:
            a = ring.criterion_call(tgt, t)
        if frozen is not None:
            a_used, steps_used = frozen
        else:
            a_used, steps_used = a, min(t, window)
        g1, g2, rare = ref_gates(a_used, alpha, steps_used)
        gates = RowGates(g1.float(), g2.float(), rare)
        for ids, tgt in step:
            rare_rows += int(rare[tgt[tgt != IGN]].sum())
            loss = three_logit_loss(model.body(ids), model.lm_head.weight, tgt, gates) / len(step)
            for acc, g in zip(total, grads(loss, *model.parameters())):
                acc += g
        if static_after is not None and t == static_after:
            frozen = (a_used, min(t, window))
        results.append((total, gates))
    assert rare_rows > 0  # parts (b) and (c) are both exercised
    return results


def _plugin_run(plugins, model, batches, start=1):
    out = []
    for t, step in enumerate(batches, start=start):
        model.zero_grad()
        plugins.step_targets([tgt for _, tgt in step], StepInfo(step=t, accumulation_steps=len(step)))
        for m, (ids, tgt) in enumerate(step):
            info = StepInfo(step=t, micro_batch=m, accumulation_steps=len(step))
            plugins.targets(tgt, info)
            logits = model(ids)
            loss = F.cross_entropy(logits.reshape(-1, 19), tgt.reshape(-1), ignore_index=IGN) / len(step)
            loss.backward()
        plugins.step_end(StepInfo(step=t, accumulation_steps=len(step)))
        out.append([p.grad.clone() for p in model.parameters()])
    return out


def test_plugin_through_aniso_plugins_gives_the_reference_gradient(tmp_path):
    torch.manual_seed(8)
    model = TiedLM().double()
    batches = _batches(steps=7)
    ref = _reference_run(model, batches, alpha=0.6, window=4)
    plugins = _ready(_plugins(), model, input_embedding="embed")
    assert model.lm_head.weight is model.embed.weight  # tying kept
    got = _plugin_run(plugins, model, batches[:5])

    # resume from a state file into a fresh plugin set: the next steps are unchanged
    plugins.save(tmp_path / "agg.safetensors")
    plugins.get("agg").head.remove()  # as a fresh process would have the plain head
    resumed = _ready(_plugins(), model, input_embedding="embed")
    resumed.load(tmp_path / "agg.safetensors")
    got += _plugin_run(resumed, model, batches[5:], start=6)
    for t, ((r_grads, _), g_grads) in enumerate(zip(ref, got), start=1):
        for r, g in zip(r_grads, g_grads):
            assert rel_err(g, r) < 1e-6, t  # gates are float32: rounding of g2 differs from the float64 reference

    metrics = resumed.measure(StepInfo(step=7))
    _, last_gates = ref[-1]
    rare = last_gates.rare
    assert metrics["aniso/agg/rare_size"] == float(rare.sum())
    assert metrics["aniso/agg/g1_mean_rare"] == pytest.approx(float(last_gates.g1[rare].double().mean()), rel=1e-6)
    assert metrics["aniso/agg/g2_mean_rare"] == pytest.approx(float(last_gates.g2[rare].double().mean()), rel=1e-6)
    assert metrics["aniso/agg/counter_bytes"] == float(resumed.get("agg").counter.nbytes) > 0


def test_plugin_static_grouping_freezes_gates():
    torch.manual_seed(9)
    model = TiedLM().double()
    batches = _batches(steps=6, seed=3)
    ref = _reference_run(model, batches, alpha=0.6, window=4, static_after=3)
    plugins = _ready(_plugins(agg_static_after=3), model, input_embedding="embed")
    got = _plugin_run(plugins, model, batches)
    for (r_grads, _), g_grads in zip(ref, got):
        for r, g in zip(r_grads, g_grads):
            assert rel_err(g, r) < 1e-6
    dynamic = _reference_run(model, batches, alpha=0.6, window=4)
    assert any(rel_err(g, r) > 1e-6 for (r, _), (g, _) in zip(dynamic[3:], ref[3:]) for r, g in zip(r, g))


def test_plugin_window_from_epoch_steps_and_errors():
    model = TiedLM().double()
    ids, tgt = _batches(steps=1)[0][0]
    plugins = _plugins(window=None)
    plugins.setup(ModelHandle(model, head="lm_head"))
    with pytest.raises(ConfigError, match="window"):
        plugins.begin_training(RunInfo())
    plugins.begin_training(RunInfo(epoch_steps=6))
    assert plugins.get("agg").counter.window == 6  # built when training begins, before any batch
    plugins.targets(tgt, StepInfo(step=1))
    with pytest.raises(ValueError, match="targets of shape"):
        model(ids[:, :-1])  # the head output has 8 positions, the targets 9
    unset = _plugins()
    with pytest.raises(RuntimeError, match="begin_training"):
        unset.targets(tgt, StepInfo(step=1))
    bad = _plugins(special_ids=(19,))
    fresh = model.__class__()
    with pytest.raises(ConfigError, match="special_ids=\\(19,\\): ids \\[19\\] are >= the vocabulary size 19"):
        bad.setup(ModelHandle(fresh, head="lm_head"))  # at set-up, before any step


def test_plugin_eval_forward_is_plain_and_keeps_targets():
    model = TiedLM().double()
    ids, tgt = _batches(steps=1)[0][0]
    plugins = _ready(_plugins(), model)
    plugins.targets(tgt, StepInfo(step=1))
    model.eval()
    torch.testing.assert_close(model(ids), F.linear(model.body(ids), model.lm_head.weight))
    assert plugins.get("agg").head.armed
    # the announced training micro-batch never ran through the gated head: AGG says so
    with pytest.raises(SetupError, match="gated forward did not run"):
        plugins.step_end(StepInfo(step=1))


def test_plugin_warns_when_the_trainer_step_is_ahead_of_the_counter(caplog):
    model = TiedLM().double()
    ids, tgt = _batches(steps=1)[0][0]
    plugins = _ready(_plugins(), model)
    with caplog.at_level("WARNING", logger="aniso_plugins"):
        plugins.targets(tgt, StepInfo(step=40))  # a resumed run whose AGG state was not loaded
    assert "step 40" in caplog.text and "counter at step 1" in caplog.text


def test_torch_compile_keeps_the_value_checks_on_the_device_and_the_gated_gradient():
    """Under torch.compile the targets' range check runs on the device (torch._assert_async): no
    graph break around the gated function (before: 2, the check reading the data), the same values
    and gradients, and a target out of range still raises."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    w = torch.randn(64, 16, requires_grad=True)
    h = torch.randn(2, 8, 16)
    y = torch.randint(0, 64, (2, 8))
    y[0, 0] = -100
    gates = agg_gates(torch.bincount(y[y >= 0], minlength=64).float(), alpha=1.5)

    def loss(w, y):
        return gated_linear(h, w, y, gates).square().sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    got = compiled(w, y)
    (grad,) = torch.autograd.grad(got, w)
    eager = loss(w, y)
    (ref,) = torch.autograd.grad(eager, w)
    assert sum(counters["graph_break"].values()) == 0
    torch.testing.assert_close(got, eager)
    torch.testing.assert_close(grad, ref)
    with pytest.raises(RuntimeError, match=r"targets must be in \[0, 64\)"):
        compiled(w, torch.full_like(y, 64))
    torch._dynamo.reset()
