"""Logits whose backward gates the weight gradient: ``gated_linear`` (docs/methods.md §1.5).

AGG's official code (``ysw1021/AGG``, ``cross_entropy_agg.py``) computes three logits per
position, z0 = sg(W)h (gradient to h only) and z1 / z2 = the gated stop-gradient trick
g ⊙ (W sg(h)) + (1−g) ⊙ sg(Wh) (gradient to W only, z1 for non-rare targets, z2 for rare
ones), and sums their NLLs. All three share one softmax p, so (docs/methods.md §1.5,
docs/performance.md §3.2) the gradients are

    ∂L/∂h_i = Wᵀ(p_i − e_{y_i})                         (plain cross-entropy),
    ∂L/∂W   = (G ⊙ Γ)ᵀ X,   G = ∂L/∂z (plain),   Γ from `RowGates`.

`gated_linear` computes that with one logits GEMM: its forward is ``F.linear`` and its backward
applies Γ to the weight gradient only: dX = G W and db = Σ_i G_i as autograd's, and
dW = Σ_blocks (G_block ⊙ Γ_block)ᵀ X_block over blocks of rows, Γ formed elementwise
(`gate_block_`: no row selected by a mask, no value read back to the host). The blocks' GEMMs
are one custom op (``aniso::gated_weight_grad``), so ``torch.compile`` keeps the backward whole.
`aniso_plugins.methods.fused_loss.head.TrainingHead` installs it in place as a head module's forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aniso_plugins.methods.fused_loss.gemm import addmm_in_, check_inputs, compute_dtypes, index_targets
from aniso_plugins.methods.fused_loss.row_gates import RowGates, columns_of, gate_block_, row_flags
from aniso_plugins.numerics.distributed import VocabShard
from aniso_plugins.numerics.linalg import ROW_BLOCK

__all__ = ["gated_linear"]

GROUP_BYTES = 64 * 2**20
"""Bytes of the float32 gated copy of one block of G's rows in `gated_linear`'s backward (between
`MIN_GROUP_ROWS` and 1024 rows): its dW GEMM is one read-modify-write of dW per block."""
MIN_GROUP_ROWS = 256


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
        ctx.meta = (ignore_index, compute, acc, hidden.dtype, weight.dtype, None if bias is None else bias.dtype, shard)
        return logits

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, w, targets, g1, g2, rare, g_target = ctx.saved_tensors
        ignore_index, compute, acc, hidden_dtype, weight_dtype, bias_dtype, shard = ctx.meta
        v, d = w.shape
        G = grad.reshape(-1, v)
        dx = dw = db = None
        with torch.autocast(x.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                dx = (G.to(compute) @ w).reshape(x.shape).to(hidden_dtype)
            if ctx.needs_input_grad[1]:
                run = torch.ops.aniso.gated_weight_grad if torch.compiler.is_compiling() else _gated_weight_grad_blocks
                dw = run(G, x.reshape(-1, d), targets.reshape(-1), g1, g2, rare, g_target, ignore_index, compute, acc,
                         shard).to(weight_dtype)
            if ctx.needs_input_grad[2]:
                db = G.sum(0, dtype=acc).to(bias_dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None


def _gated_weight_grad_blocks(G: torch.Tensor, X: torch.Tensor, y: torch.Tensor, g1: torch.Tensor, g2: torch.Tensor,
                              rare: torch.Tensor, g_target: torch.Tensor | None, ignore_index: int, compute: torch.dtype,
                              acc: torch.dtype, shard: list[int] | None) -> torch.Tensor:
    """(G ⊙ Γ)ᵀ X accumulated in at least float32 (the rows ``[start, stop)`` of a vocabulary
    shard: G holds their columns), GEMMs on `compute` operands (`addmm_in_`), over blocks of rows
    whose gated copy takes `GROUP_BYTES`."""
    v, d = G.shape[1], X.shape[1]
    start = 0 if shard is None else shard[0]
    valid = y != ignore_index
    safe = torch.where(valid, y, 0)
    flags = row_flags(RowGates(g1, g2, rare, g_target), safe, valid, acc)
    local, owned = columns_of(safe, valid, start, start + v)
    gate1, gate2 = g1.to(acc)[start : start + v], g2.to(acc)[start : start + v]
    dw = torch.zeros(v, d, dtype=acc, device=G.device)
    step = min(ROW_BLOCK, max(MIN_GROUP_ROWS, GROUP_BYTES // (4 * max(v, 1))))
    for s in range(0, G.shape[0], step):
        block = G[s : s + step].to(acc, copy=True)
        k = slice(s, s + block.shape[0])
        targets = block.gather(1, local[k, None]).squeeze(1) * flags.target_gate[k]
        gate_block_(block, flags.rare[k], gate1, gate2, local[k], owned[k], targets)
        addmm_in_(dw, block.T, X[k], compute)
    return dw


@torch.library.custom_op("aniso::gated_weight_grad", mutates_args=())
def _gated_weight_grad(G: torch.Tensor, X: torch.Tensor, y: torch.Tensor, g1: torch.Tensor, g2: torch.Tensor,
                       rare: torch.Tensor, g_target: torch.Tensor | None, ignore_index: int, compute: torch.dtype,
                       acc: torch.dtype, shard: list[int] | None) -> torch.Tensor:
    """`_gated_weight_grad_blocks` as one op for ``torch.compile`` (eagerly it runs op by op)."""
    return _gated_weight_grad_blocks(G, X, y, g1, g2, rare, g_target, ignore_index, compute, acc, shard)


@_gated_weight_grad.register_fake
def _(G, X, y, g1, g2, rare, g_target, ignore_index, compute, acc, shard):
    return G.new_empty((G.shape[1], X.shape[1]), dtype=acc)


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
    bounds = None if shard is None else [shard.start, shard.stop, shard.total]
    return _GatedLinear.apply(
        hidden, weight, bias, targets, gates.g1, gates.g2, gates.rare, gates.g_target, ignore_index, dtypes, bounds
    )
