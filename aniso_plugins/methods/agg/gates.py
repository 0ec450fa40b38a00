"""AGG: adaptive gradient gating of rare-token embeddings (Yu et al., ACL 2022; docs/methods.md §1).

The official code (``ysw1021/AGG``, ``cross_entropy_agg.py``) computes three logits per
position, z0 = sg(W)h (gradient to h only) and z1 / z2 = the gated stop-gradient trick
g ⊙ (W sg(h)) + (1−g) ⊙ sg(Wh) (gradient to W only, z1 for non-rare targets, z2 for rare
ones), and sums their NLLs. All three share one softmax p, so (docs/methods.md §1.5,
docs/performance.md §3.2) the gradients are

    ∂L/∂h_i = Wᵀ(p_i − e_{y_i})                         (plain cross-entropy),
    ∂L/∂W   = (G ⊙ Γ)ᵀ X,   G = ∂L/∂z (plain),   Γ_ik = g1_k if y_i ∉ V_r, g2_k if y_i ∈ V_r,
                                                   Γ_{i,y_i} = 1 (the target entry is never gated).

`agg_linear` computes that with one logits GEMM: its forward is ``F.linear`` and its backward
applies Γ to the weight gradient only, without any N×V tensor beyond the incoming gradient:
``dW = diag(g_base)·GᵀX + Σ_{i∈S} ((g_other − g_base) ⊙ G_i) x_iᵀ + target-entry corrections``,
where the base gate is that of the larger row group and S the smaller group (usually the few
rare-target rows). `aniso_plugins.methods.fused_loss.head.TrainingHead` installs it in place as a head module's forward.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["AGGGates", "agg_gates", "agg_linear"]

#: The official code's guard on the mean rare count: g2 = min(c_k / (c̄_r + 1e-7), 1).
G2_EPS = 1e-7
#: Rows of a row group gathered per GEMM in `agg_linear`'s backward.
_GROUP_CHUNK = 256
#: Above this fraction of rows in the smaller row group, `agg_linear`'s backward runs one GEMM per
#: group instead of a full GEMM plus a correction over the group (docs/performance.md §3.2).
SPLIT_FRACTION = 0.2


@dataclass(frozen=True)
class AGGGates:
    """Per-vocabulary-id gates of one micro-batch (detached constants, float32, shape (V,)).

    g1: factor on the logit gradient of id k in rows whose target is not rare (part (b) of
        docs/methods.md §0 for rare k); 1 on non-rare ids.
    g2: the same in rows whose target is rare (part (c)); 1 on non-rare ids.
    rare: bool (V,), the rare group V_r (decides which of g1 / g2 a row uses).
    g_target: factor on the target entry (i, y_i) (part (a)); None means 1, as the official
        code (``gate[row, y_i] = 1``).
    """

    g1: torch.Tensor
    g2: torch.Tensor
    rare: torch.Tensor
    g_target: torch.Tensor | None = None

    def __post_init__(self) -> None:
        v = self.g1.shape
        for name in ("g1", "g2", "rare", "g_target"):
            t = getattr(self, name)
            if t is None:
                continue
            if t.dim() != 1 or t.shape != v:
                raise ValueError(f"AGGGates.{name}: expected shape {tuple(v)} like g1, got {tuple(t.shape)}")
        if self.rare.dtype != torch.bool:
            raise TypeError(f"AGGGates.rare: expected a bool tensor, got {self.rare.dtype}")

    @property
    def vocab_size(self) -> int:
        return self.g1.shape[0]

    def to(self, device: torch.device | str) -> AGGGates:
        """The same gates on `device` (self when already there)."""
        if self.g1.device == torch.device(device):
            return self
        target = None if self.g_target is None else self.g_target.to(device)
        return AGGGates(self.g1.to(device), self.g2.to(device), self.rare.to(device), target)


def agg_gates(
    appearance: torch.Tensor,
    alpha: float,
    *,
    steps: int = 1,
    g1: bool = True,
    g2: bool = True,
    parts: Iterable[str] = ("b", "c"),
    freeze_rare: bool = False,
) -> AGGGates:
    """Gates from the token appearance, as the official code (docs/methods.md §1.2-1.3).

        V_r = {k : a_k < α}                                          (strict),
        g1_k = a_k on V_r, 1 elsewhere,
        g2_k = min(a_k / (ā_r + ε/steps), 1) on V_r, 1 elsewhere,    ā_r = mean_{r∈V_r} a_r,

    with ε = 1e-7: the official guard ``c_k / (c̄_r + 1e-7)`` is on counts c = a·steps, so pass
    ``steps = min(t, K)`` (`SlidingTokenCounter.steps_in_window`) for the same guard (equal up to
    float32 rounding). Comparisons and gates are float32, as in the official code. An empty
    rare group gives all gates 1; a rare group that never occurred gives g2 = 0 on it.

    Ablations (seed §3 and Table 8-9; each leaves everything else unchanged):
        g1=False: g1 = 1 (part (b) ungated, "no g1"); g2=False: g2 = 1 ("no g2");
        parts: which parts of a rare id's gradient are gated: "b" (non-rare-target rows, by
            g1), "c" (other rare-target rows, by g2), "a" (its own target rows, by a_k; the
            official code never gates (a)); leaving "b" out equals g1=False, "c" g2=False;
        freeze_rare: the seed's Freeze experiment: every output-side gradient entry of a rare
            id is 0 (parts (a), (b) and (c)), whatever the other options.
    """
    if appearance.dim() != 1 or not appearance.dtype.is_floating_point:
        raise ValueError(
            f"appearance: expected a float tensor of shape (V,), got {appearance.dtype} {tuple(appearance.shape)}"
        )
    if not (isinstance(alpha, (int, float)) and alpha > 0):
        raise ValueError(f"alpha={alpha!r}: expected a number > 0")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}: expected an integer >= 1 (min(t, K))")
    parts = tuple(parts)
    bad = [p for p in parts if p not in ("a", "b", "c")]
    if bad:
        raise ValueError(f"parts={parts!r}: {bad} are not parts; expected any of 'a', 'b', 'c'")
    a = appearance.to(torch.float32)
    rare = a < alpha
    one = torch.ones_like(a)
    n_rare = rare.sum()
    mean_rare = torch.where(rare, a, 0.0).sum() / n_rare.clamp_min(1)
    gate1 = torch.where(rare, a, one) if (g1 and "b" in parts) else one.clone()
    ratio = (a / (mean_rare + G2_EPS / steps)).clamp(max=1.0)
    gate2 = torch.where(rare, ratio, one) if (g2 and "c" in parts) else one.clone()
    target = torch.where(rare, a, one) if "a" in parts else None
    if freeze_rare:
        zero = torch.zeros_like(a)
        gate1, gate2 = torch.where(rare, zero, gate1), torch.where(rare, zero, gate2)
        target = torch.where(rare, zero, one)
    return AGGGates(gate1, gate2, rare, target)


# --- the gated weight gradient, shared with the fused cross-entropy ---------------------------


class RowGating(NamedTuple):
    """How Γ acts on N rows, for a weight gradient computed as base-scaled GEMM + corrections.

    base / other: (V,) gate vectors of the larger / smaller row group (g1 for non-rare-target
    rows, which include ignored rows, g2 for rare-target rows); in_other: (N,) bool, rows of
    the smaller group; target_fix: (N,) factor to add at entry (i, y_i) so that its gate
    becomes g_target[y_i] (1 by default) instead of the row's group gate (0 on ignored rows)."""

    base: torch.Tensor
    other: torch.Tensor
    in_other: torch.Tensor
    target_fix: torch.Tensor


def row_gating(gates: AGGGates, targets: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> RowGating:
    """`RowGating` for flat `targets` (N,) with `valid` = targets != ignore_index."""
    safe = torch.where(valid, targets, 0)
    rare_row = valid & gates.rare[safe]
    n = targets.numel()
    if 2 * int(rare_row.sum()) <= n:
        base, other, in_other = gates.g1, gates.g2, rare_row
    else:
        base, other, in_other = gates.g2, gates.g1, ~rare_row
    base, other = base.to(dtype), other.to(dtype)
    applied = torch.where(in_other, other[safe], base[safe])
    wanted = torch.ones_like(applied) if gates.g_target is None else gates.g_target.to(dtype)[safe]
    fix = torch.where(valid, wanted - applied, 0.0)
    return RowGating(base, other, in_other, fix)


def _check_weight(weight: torch.Tensor, where: str) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):
        raise TypeError(
            f"{where}: weight is a DTensor with placements {weight.placements}; it needs the full (V, d) "
            "weight: call it where FSDP2 has unsharded the parameter (inside the head module's forward)"
        )
    if weight.dim() != 2:
        raise ValueError(f"{where}: weight must be 2-D (V, d), got shape {tuple(weight.shape)}")


def check_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    gates: AGGGates | None,
    ignore_index: int,
    where: str,
) -> None:
    """Shape, dtype and range checks shared by `agg_linear` and the fused cross-entropy."""
    _check_weight(weight, where)
    v, d = weight.shape
    if hidden.shape[-1] != d:
        raise ValueError(f"{where}: hidden has {hidden.shape[-1]} features, weight expects {d}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"{where}: targets of shape {tuple(targets.shape)} do not match the positions of hidden "
            f"{tuple(hidden.shape[:-1])} (targets must be aligned with the head's output positions)"
        )
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise TypeError(f"{where}: targets must be integer token ids, got {targets.dtype}")
    if gates is not None and gates.vocab_size != v:
        raise ValueError(f"{where}: gates are for {gates.vocab_size} ids, weight has {v} rows")
    if torch.compiler.is_compiling():  # the value check reads the data: a graph break under torch.compile
        return
    flat = targets[targets != ignore_index]
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= v):
        raise ValueError(
            f"{where}: targets must be in [0, {v}) or equal ignore_index={ignore_index}; "
            f"got values in [{int(flat.min())}, {int(flat.max())}]"
        )


def compute_dtypes(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """(GEMM dtype, accumulation dtype, logits dtype) for the head.

    Under autocast the GEMMs run in the autocast dtype and the logits come out in float32
    (so the logit gradient arrives in float32); the weight gradient always accumulates in at
    least float32. Without autocast everything is the weight's dtype, as ``F.linear``."""
    acc = torch.promote_types(weight.dtype, torch.float32)
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and weight.dtype.is_floating_point:
        return torch.get_autocast_dtype(device), acc, acc
    return weight.dtype, acc, weight.dtype


UPCAST_ROWS = 512
"""Rows of `out` per block of `addmm_in_`'s CPU path (0.75 + 1.5 MiB of buffers at d = 768;
faster than 2048 rows at d = 768 and 2048; see `addmm_in_`)."""


def addmm_in_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, compute: torch.dtype,
              product: torch.Tensor | None = None, row_scale: torch.Tensor | None = None) -> None:
    """``out += a @ b`` with the GEMM's operands in `compute`, the head's GEMM dtype.

    As autograd computes ``F.linear``'s weight gradient under autocast, and as Liger-Kernel's
    fused linear cross-entropy accumulates dW: a `compute`-dtype GEMM (float32 accumulation inside
    it), its product rounded to `compute` once and added into the float32 `out`; when `compute` is
    `out`'s dtype, ``out.addmm_(a, b)``. A float32 GEMM in a bf16 step would run at the GPU's
    float32 rate, many times slower than plain autograd's (docs/performance.md §7.3).
    `row_scale`: ``out += diag(row_scale) · (a @ b)`` (only where `compute` differs from out's
    dtype: the scale applies to the float32 product, after its one rounding).

    Off the CPU the product is one GEMM into `product` (a buffer of out's shape in `compute`,
    reused across calls, or None) and one mixed-dtype add. On the CPU it is computed in blocks of
    `UPCAST_ROWS` rows of `out`, each rounded, converted into a small float32 buffer and added:
    no `out`-sized product (at V = 32768, d = 2048: 128 MiB less), and a mixed-dtype ``add_``
    converts through a full-size temporary, measured at 35-180 ms for a 32768 × 768 bf16 product
    against 5 ms for the blocks (docs/performance.md §7.3); the blocked GEMMs and adds take about
    the time of the one GEMM and its blocked add (a 1024-row chunk at V = 32768, median of 8
    interleaved runs: 72.5 against 72.2 ms at d = 768, 200 against 186 ms at d = 2048)."""
    if compute == out.dtype:
        if row_scale is not None:
            raise ValueError("addmm_in_: row_scale is for a product in a narrower dtype than out")
        out.addmm_(a.to(compute), b.to(compute))
    elif out.device.type == "cpu":
        _add_rounded_product_blocked_(out, a.to(compute), b.to(compute), row_scale)
    else:
        _add_rounded_product_(out, a.to(compute), b.to(compute), product, row_scale)


def _add_rounded_product_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, product: torch.Tensor | None,
                          row_scale: torch.Tensor | None) -> None:
    """`addmm_in_` off the CPU: one GEMM into `product` (or a new tensor) and one mixed-dtype add."""
    src = torch.mm(a, b, out=product)
    if row_scale is None:
        out.add_(src)
    else:
        out.addcmul_(src, row_scale[:, None].to(out.dtype))


def _add_rounded_product_blocked_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                                  row_scale: torch.Tensor | None) -> None:
    """`addmm_in_` on the CPU: blocks of `UPCAST_ROWS` rows of `out`, each a GEMM into a small
    buffer of `a`'s dtype, converted into a small float32 one, scaled and added."""
    rows = min(UPCAST_ROWS, out.shape[0])
    part = torch.empty(rows, out.shape[1], dtype=a.dtype)
    stage = torch.empty(rows, out.shape[1], dtype=out.dtype)
    for i in range(0, out.shape[0], UPCAST_ROWS):
        n = min(UPCAST_ROWS, out.shape[0] - i)
        block = stage[:n].copy_(torch.mm(a[i : i + n], b, out=part[:n]))
        if row_scale is not None:
            block.mul_(row_scale[i : i + n, None])
        out[i : i + n].add_(block)


class _AGGLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, g1, g2, rare, g_target, ignore_index, dtypes):
        compute, acc, out = dtypes
        with torch.autocast(hidden.device.type, enabled=False):
            x = hidden.to(compute)
            w = weight.to(compute)
            logits = F.linear(x, w, None if bias is None else bias.to(compute))
            logits = logits.to(out)
        ctx.save_for_backward(x, w, targets, g1, g2, rare, g_target)
        ctx.meta = (ignore_index, dtypes, hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return logits

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, w, targets, g1, g2, rare, g_target = ctx.saved_tensors
        ignore_index, (compute, acc, _), hidden_dtype, weight_dtype, bias_dtype = ctx.meta
        v, d = w.shape
        G = grad.reshape(-1, v)
        X = x.reshape(-1, d)
        dx = dw = db = None
        with torch.autocast(x.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                dx = (G.to(compute) @ w).reshape(x.shape).to(hidden_dtype)
            if ctx.needs_input_grad[1]:
                gates = AGGGates(g1, g2, rare, g_target)
                dw = _gated_weight_grad(G, X, targets.reshape(-1), gates, ignore_index, compute, acc)
                dw = dw.to(weight_dtype)
            if ctx.needs_input_grad[2]:
                db = G.sum(0, dtype=acc).to(bias_dtype)
        return dx, dw, db, None, None, None, None, None, None, None


def _gated_weight_grad(
    G: torch.Tensor,
    X: torch.Tensor,
    y: torch.Tensor,
    gates: AGGGates,
    ignore_index: int,
    compute: torch.dtype,
    acc: torch.dtype,
) -> torch.Tensor:
    """(G ⊙ Γ)ᵀ X accumulated in `acc`, its GEMMs on `compute` operands (`addmm_in_`), without
    forming G ⊙ Γ (see the module docstring). Up to `SPLIT_FRACTION` of the rows in the smaller
    group S: diag(base)·GᵀX plus a correction GEMM over S; above it (up to half the rows, where
    the correction would cost half a GEMM more) the two groups' GEMMs over their own rows,
    diag(base)·G_¬SᵀX_¬S + diag(other)·G_SᵀX_S: the FLOPs of one GEMM, for a second V × d buffer
    and the rows gathered `_GROUP_CHUNK` at a time."""
    valid = y != ignore_index
    rg = row_gating(gates, y, valid, acc)
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
        yf = y[fixed]
        coef = rg.target_fix[fixed] * G[fixed, yf].to(acc)
        dw.index_add_(0, yf, coef[:, None] * X[fixed].to(acc))
    return dw


def _add_rows_product(out: torch.Tensor, G: torch.Tensor, X: torch.Tensor, rows: torch.Tensor, compute: torch.dtype) -> None:
    """``out += G[rows]ᵀ X[rows]``, `_GROUP_CHUNK` gathered rows per GEMM."""
    for s in range(0, rows.numel(), _GROUP_CHUNK):
        r = rows[s : s + _GROUP_CHUNK]
        addmm_in_(out, G[r].T, X[r], compute)


def agg_linear(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    gates: AGGGates,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Logits ``F.linear(hidden, weight, bias)`` whose backward gates the weight gradient (AGG).

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
    """
    check_inputs(hidden, weight, targets, gates, ignore_index, "agg_linear")
    dtypes = compute_dtypes(hidden, weight)
    gates = gates.to(weight.device)
    targets = targets.to(hidden.device)
    return _AGGLinear.apply(
        hidden, weight, bias, targets, gates.g1, gates.g2, gates.rare, gates.g_target, ignore_index, dtypes
    )
