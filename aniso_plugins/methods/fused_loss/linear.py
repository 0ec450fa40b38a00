"""Logits whose backward gates the weight gradient: ``gated_linear`` (docs/methods.md §1.5).

AGG's official code (``ysw1021/AGG``, ``cross_entropy_agg.py``) computes three logits per
position, z0 = sg(W)h (gradient to h only) and z1 / z2 = the gated stop-gradient trick
g ⊙ (W sg(h)) + (1−g) ⊙ sg(Wh) (gradient to W only, z1 for non-rare targets, z2 for rare
ones), and sums their NLLs. All three share one softmax p, so (docs/methods.md §1.5,
docs/performance.md §3.2) the gradients are

    ∂L/∂h_i = Wᵀ(p_i − e_{y_i})                         (plain cross-entropy),
    ∂L/∂W   = (G ⊙ Γ)ᵀ X,   G = ∂L/∂z (plain),   Γ from `RowGates`.

`gated_linear` computes that with one logits GEMM: its forward is ``F.linear`` and its backward
applies Γ to the weight gradient only, without any N×V tensor beyond the incoming gradient:
``dW = diag(g_base)·GᵀX + Σ_{i∈S} ((g_other − g_base) ⊙ G_i) x_iᵀ + target-entry corrections``,
where the base gate is that of the larger row group and S the smaller group (usually the few
rare-target rows). `aniso_plugins.methods.fused_loss.head.TrainingHead` installs it in place as a
head module's forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aniso_plugins.methods.fused_loss.gemm import addmm_in_, check_inputs, compute_dtypes, index_targets
from aniso_plugins.methods.fused_loss.row_gates import RowGates, row_gating
from aniso_plugins.numerics.distributed import VocabShard

__all__ = ["SPLIT_FRACTION", "gated_linear"]

#: Rows of a row group gathered per GEMM in `gated_linear`'s backward.
_GROUP_CHUNK = 256
#: Above this fraction of rows in the smaller row group, `gated_linear`'s backward runs one GEMM per
#: group instead of a full GEMM plus a correction over the group (docs/performance.md §3.2).
SPLIT_FRACTION = 0.2


class _GatedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, g1, g2, rare, g_target, ignore_index, dtypes, shard):
        compute, acc, out = dtypes
        with torch.autocast(hidden.device.type, enabled=False):
            x = hidden.to(compute)
            w = weight.to(compute)
            logits = F.linear(x, w, None if bias is None else bias.to(compute))
            logits = logits.to(out)
        ctx.save_for_backward(x, w, targets, g1, g2, rare, g_target)
        ctx.meta = (ignore_index, dtypes, hidden.dtype, weight.dtype, None if bias is None else bias.dtype, shard)
        return logits

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, w, targets, g1, g2, rare, g_target = ctx.saved_tensors
        ignore_index, (compute, acc, _), hidden_dtype, weight_dtype, bias_dtype, shard = ctx.meta
        v, d = w.shape
        G = grad.reshape(-1, v)
        X = x.reshape(-1, d)
        dx = dw = db = None
        with torch.autocast(x.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                dx = (G.to(compute) @ w).reshape(x.shape).to(hidden_dtype)
            if ctx.needs_input_grad[1]:
                gates = RowGates(g1, g2, rare, g_target)
                dw = _gated_weight_grad(G, X, targets.reshape(-1), gates, ignore_index, compute, acc, shard)
                dw = dw.to(weight_dtype)
            if ctx.needs_input_grad[2]:
                db = G.sum(0, dtype=acc).to(bias_dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None


def _gated_weight_grad(
    G: torch.Tensor,
    X: torch.Tensor,
    y: torch.Tensor,
    gates: RowGates,
    ignore_index: int,
    compute: torch.dtype,
    acc: torch.dtype,
    shard: VocabShard | None = None,
) -> torch.Tensor:
    """(G ⊙ Γ)ᵀ X accumulated in `acc` (the rows of `shard` of it: G holds their columns), its GEMMs on `compute` operands (`addmm_in_`), without
    forming G ⊙ Γ (see the module docstring). Up to `SPLIT_FRACTION` of the rows in the smaller
    group S: diag(base)·GᵀX plus a correction GEMM over S; above it (up to half the rows, where
    the correction would cost half a GEMM more) the two groups' GEMMs over their own rows,
    diag(base)·G_¬SᵀX_¬S + diag(other)·G_SᵀX_S: the FLOPs of one GEMM, for a second V × d buffer
    and the rows gathered `_GROUP_CHUNK` at a time."""
    valid = y != ignore_index
    rg = row_gating(gates, y, valid, acc, shard)
    rows = rg.in_other.nonzero().squeeze(1)
    v, d = G.shape[1], X.shape[1]
    dw = torch.zeros(v, d, dtype=acc, device=G.device)
    if rows.numel() <= SPLIT_FRACTION * G.shape[0]:
        addmm_in_(dw, G.T, X, compute)
        dw.mul_(rg.base[:, None])
        diff = rg.other - rg.base
        for s in range(0, rows.numel(), _GROUP_CHUNK):
            r = rows[s : s + _GROUP_CHUNK]
            addmm_in_(dw, (G[r].to(acc) * diff).T, X[r], compute)
    else:
        _add_rows_product(dw, G, X, (~rg.in_other).nonzero().squeeze(1), compute)
        dw.mul_(rg.base[:, None])
        other = torch.zeros_like(dw)
        _add_rows_product(other, G, X, rows, compute)
        dw.addcmul_(other, rg.other[:, None])
        del other
    fixed = rg.target_fix.nonzero().squeeze(1)
    if fixed.numel():
        yf = rg.target_index[fixed]
        coef = rg.target_fix[fixed] * G[fixed, yf].to(acc)
        dw.index_add_(0, yf, coef[:, None] * X[fixed].to(acc))
    return dw


def _add_rows_product(out: torch.Tensor, G: torch.Tensor, X: torch.Tensor, rows: torch.Tensor, compute: torch.dtype) -> None:
    """``out += G[rows]ᵀ X[rows]``, `_GROUP_CHUNK` gathered rows per GEMM."""
    for s in range(0, rows.numel(), _GROUP_CHUNK):
        r = rows[s : s + _GROUP_CHUNK]
        addmm_in_(out, G[r].T, X[r], compute)


def gated_linear(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    row_gates: RowGates,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    shard: VocabShard | None = None,
) -> torch.Tensor:
    """Logits ``F.linear(hidden, weight, bias)`` whose backward gates the weight gradient by `row_gates` (AGG's, `agg_gates`).

    Backward (docs/methods.md §1.5): the gradient to `hidden` (and everything before it) and to
    `bias` is the ordinary one; the gradient to `weight` is ``(G ⊙ Γ)ᵀ X`` with G the incoming
    logit gradient and Γ_ik = g1_k (target y_i not rare), g2_k (y_i rare), Γ_{i,y_i} =
    g_target[y_i] (1 by default). Rows with ``targets == ignore_index`` are gated like
    non-rare-target rows (under cross-entropy their gradient is 0 anyway). Combined with
    cross-entropy, the gradients equal the official three-logit construction (z0 = sg(W)h,
    z1/z2 gated to W only), but the loss is plain CE, not the official 2× (docs/methods.md §1.6.2).

    hidden: (..., d); weight: (V, d), a full tensor (under FSDP2 call it inside the head's
    forward, where the parameter is unsharded); targets: (...) ids aligned with the output
    positions. Under autocast the GEMMs run in the autocast dtype and the logits are returned
    in float32; the weight gradient is accumulated in float32 (at least).

    shard: tensor parallelism (loss parallel): `weight` (and `bias`) hold the vocabulary ids
    ``[shard.start, shard.stop)`` and the logits are theirs; `targets` and `row_gates` stay
    global (each row's group is decided by its global target), and the target-entry factor
    applies on the rank that holds the target's row.
    """
    check_inputs(hidden, weight, targets, row_gates, ignore_index, "gated_linear", shard)
    dtypes = compute_dtypes(hidden, weight)
    gates = row_gates.to(weight.device)
    targets = index_targets(targets, hidden.device)
    return _GatedLinear.apply(
        hidden, weight, bias, targets, gates.g1, gates.g2, gates.rare, gates.g_target, ignore_index, dtypes, shard
    )
