"""Training-time regularizers of the LM head (output embedding) W ∈ R^{V×d}, row w_i.

Each function returns the *unweighted* penalty R(W) as a differentiable 0-d float64 tensor;
its weight (γ of CosReg, λ of the hinge and of spectrum control) is ``config.reg_weight``,
applied in one place, `aniso_plugins.methods.regularizers.plugin.RegularizerPlugin`.

- `cosreg`: Gao et al. 2019 (ICLR), docs/methods.md §3, exact in O(Vd).
- `cosine_hinge`: pairwise cosine hinge of seed 000, docs/methods.md §3.1, exact blockwise in
  O(V²d) time and O(block·V) extra memory, or sampled (unbiased) in O(sample·V·d).
- `spectrum_penalty`: Wang et al. 2020 (ICLR) singular-value priors, docs/methods.md §4, and the
  σ1/σd ratio of seed 000, through the d×d Gram matrix (`aniso_plugins.numerics.linalg`).

Where the rows live (every function, same rule):

- a plain tensor (single process, a DDP replica, or the FSDP2-unsharded weight inside the
  head's forward) is computed in full on every rank: every rank gets the same global value and
  the full gradient, which DDP / FSDP gradient averaging leaves unchanged;
- a DTensor ``Shard(0)`` parameter (FSDP2, read outside the forward) is computed from its local
  shard (`aniso_plugins.local_rows`) plus SUM reductions over the mesh of the O(d) / O(d²)
  statistics (the hinge all-gathers rows block by block); the value equals the single-process
  value on every rank and, when every rank backpropagates it once, the local shard's gradient
  equals its rows of the single-process gradient;
- a ``Replicate`` DTensor is computed in full from its local tensor.

Numerics: rows are normalized and multiplied in float32 (bf16/fp16 weights are upcast, autocast
is disabled inside), statistics and values are accumulated in float64; spectrum control's Gram
sums float32 products of row blocks in float64 (`aniso_plugins.numerics.linalg.block_gram`: no
float64 copy of W).

No host read (docs/performance.md §5.8): N and the normalisers stay on the device, the pairs
j = i and the excluded ids are placed from Python integers, the sampled ids are drawn on the
host and copied without blocking (`aniso_plugins.numerics.rows`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist

from aniso_plugins.numerics.distributed import ceil_div
from aniso_plugins.numerics.linalg import ROW_BLOCK, block_gram, singular_values
from aniso_plugins.numerics.rows import (
    GradientInForward,
    check_ids,
    column_block,
    global_sum,
    gather_sampled,
    mask_diagonal,
    mask_own,
    no_autocast,
    own_diagonal,
    sample_ids,
    split_rows,
    unit_rows,
    valid_count,
)

Prior = Literal["poly", "exp", "ratio"]
PRIORS: tuple[str, ...] = ("poly", "exp", "ratio")


def cosreg(weight: torch.Tensor, exclude_ids: Sequence[int] = ()) -> torch.Tensor:
    """CosReg, Gao et al. 2019 (ICLR, §5), docs/methods.md §3:

        R = 1/N² · Σ_i Σ_{j≠i} ŵ_iᵀŵ_j = (‖Σ_i ŵ_i‖² − N) / N²,   ŵ_i = w_i / ‖w_i‖,

    exact in O(Vd) through the right-hand identity (ŵ_i in float32, so ‖ŵ_i‖² = 1 holds to float32
    rounding: R is exact to ~1e-7/N absolute). Normalizer N², not N(N−1), as in the paper
    (so R = mean pairwise cosine · (N−1)/N). The sums run over the *valid* rows: rows of norm 0
    (e.g. a zero-initialised pad row) and `exclude_ids` are left out, and N is the number of the
    remaining rows (R = 0 when N = 0). The paper's γ is ``config.reg_weight`` (γ = 1 there).
    Gradient (autograd): ∂R/∂w_i = 2/(N²‖w_i‖) · (I − ŵ_iŵ_iᵀ)(s − ŵ_i), s = Σ_j ŵ_j. Sharded
    weights reduce s (d floats) and N. Returns a 0-d float64 tensor."""
    parts = split_rows(weight, "cosreg")
    with no_autocast(parts.rows):
        unit, valid = unit_rows(parts, exclude_ids)
        total = global_sum(unit.sum(0, dtype=torch.float64), parts.group)
        n = valid_count(valid, parts.group)
        return (total.dot(total) - n) / n.clamp_min(1.0).square()


class _HingeExact(GradientInForward):
    """Σ_{i local} Σ_{j≠i} max(0, ûᵢᵀûⱼ − γ) over all ranks, times `scale` (a 0-d tensor), with
    the gradient 2·M·Û (M = 1[cos > γ], symmetric) accumulated in the forward, block by block."""

    @staticmethod
    def forward(ctx, unit, valid, offset, total, margin, block, scale, group):
        n, d = unit.shape
        world = 1 if group is None else dist.get_world_size(group)
        shard = ceil_div(total, world)  # rows on the largest shard (torch.chunk partition)
        rounds = ceil_div(shard, block)
        flagged = torch.cat([unit, valid.unsqueeze(1).to(unit.dtype)], 1)
        grad = torch.zeros_like(unit) if ctx.needs_input_grad[0] else None
        value = torch.zeros((), dtype=torch.float64, device=unit.device)
        for k in range(rounds):
            cols, _ = column_block(flagged, k * block, block, total, group)
            cos = unit @ cols[:, :d].T  # (n, ≤ world·block): the only O(block·V) tensor
            cos.masked_fill_(~valid.unsqueeze(1), -math.inf)
            cos.masked_fill_(~(cols[:, d] > 0).unsqueeze(0), -math.inf)
            mask_diagonal(cos, own_diagonal(offset, n, k * block, block, total, group), -math.inf)  # j = i
            if grad is not None:
                grad.addmm_((cos > margin).to(unit.dtype), cols[:, :d], alpha=2.0)
            value += cos.sub_(margin).clamp_min_(0.0).sum(dtype=torch.float64)
        if group is not None:
            dist.all_reduce(value, group=group)
        if grad is not None:
            ctx.save_for_backward(grad.mul_(scale))
        return value * scale


class _HingeSampled(GradientInForward):
    """Σ_{i∈S} Σ_{j≠i} max(0, ûᵢᵀûⱼ − γ), times `scale`; gradient Mᵀ Û_S on every row j plus
    M Û on the sampled rows i (M = 1[cos > γ], S × V), accumulated in the forward."""

    @staticmethod
    def forward(ctx, unit, valid, offset, sample_ids, margin, block, scale, group):
        n, d = unit.shape
        own = sample_ids - offset
        mine = (own >= 0) & (own < n)
        rows = gather_sampled(torch.cat([unit, valid.unsqueeze(1).to(unit.dtype)], 1), own, mine, group)
        rows_unit, rows_valid = rows[:, :d], rows[:, d] > 0
        want_grad = ctx.needs_input_grad[0]
        grad = torch.zeros_like(unit) if want_grad else None
        row_grad = torch.zeros_like(rows_unit) if want_grad else None
        value = torch.zeros((), dtype=torch.float64, device=unit.device)
        for b in range(0, len(sample_ids), block):
            ru = rows_unit[b : b + block]
            cos = ru @ unit.T  # (≤ block, n)
            cos.masked_fill_(~rows_valid[b : b + block].unsqueeze(1), -math.inf)
            cos.masked_fill_(~valid.unsqueeze(0), -math.inf)
            mask_own(cos, own[b : b + block], mine[b : b + block], -math.inf)  # j = i
            if want_grad:
                active = (cos > margin).to(unit.dtype)
                grad.addmm_(active.T, ru)
                row_grad[b : b + block] = active @ unit
            value += cos.sub_(margin).clamp_min_(0.0).sum(dtype=torch.float64)
        if group is not None:
            dist.all_reduce(value, group=group)
        if want_grad:
            if group is not None:
                dist.all_reduce(row_grad, group=group)
            if n:
                grad.index_add_(0, own.clamp(0, n - 1), torch.where(mine.unsqueeze(1), row_grad, 0.0))
            ctx.save_for_backward(grad.mul_(scale))
        return value * scale


def cosine_hinge(
    weight: torch.Tensor,
    margin: float,
    *,
    block: int = ROW_BLOCK,
    sample: int | None = None,
    generator: torch.Generator | None = None,
    exclude_ids: Sequence[int] = (),
) -> torch.Tensor:
    """Pairwise cosine hinge of seed 000 ("cosine spectrum control"), docs/methods.md §3.1:

        R = 1/N² · Σ_i Σ_{j≠i} max(0, cos(w_i, w_j) − γ),   γ = `margin`.

    Normalization: the seed writes λ Σ_i Σ_{j≠i}; we divide by N², like CosReg, so the seed's
    λ is ``reg_weight / N²``. Ordered pairs: each unordered pair is counted twice (½ is *not*
    absorbed). With γ = −1 this is CosReg plus N(N−1)/N²; with γ ≥ 1 it is 0. N counts the valid
    rows (norm > 0, not in `exclude_ids`), which alone take part.

    Exact mode (``sample=None``): blocks of `block` columns, extra memory O(block·V) (never V×V),
    time 4V²d flops for value and gradient. The gradient is computed in the forward by a custom
    autograd Function (docs/performance.md §5.4): ∂R/∂û_i = 2/N² Σ_j 1[cos_ij > γ] û_j, then autograd
    through the normalization, ∂/∂w_i = (I − û_iû_iᵀ)/‖w_i‖ · ∂/∂û_i. Sharded weights all-gather
    `block` rows per rank and round.

    Sampled mode (``sample=s``): rows S = P[torch.randperm(|P|, generator=generator)[:s]],
    P the ids not in `exclude_ids` in increasing order (pass a generator seeded identically on
    every rank); R̂ = |P|/s · 1/N² Σ_{i∈S} Σ_{j≠i} max(0, cos_ij − γ), an unbiased estimate of R
    (E over S of every row's inclusion is s/|P|), and its gradient (rows i ∈ S and every row j
    through cos_ij) is the unbiased estimate of ∂R. Cost 6·s·V·d flops, memory O(block·V).
    ``sample >= |P|`` computes the exact value. Returns a 0-d float64 tensor."""
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"block={block!r}: expected an integer >= 1 (rows per block)")
    if sample is not None and (not isinstance(sample, int) or isinstance(sample, bool) or sample < 1):
        raise ValueError(f"sample={sample!r}: expected None (exact) or an integer >= 1 (rows per step)")
    if not isinstance(margin, (int, float)) or isinstance(margin, bool) or not math.isfinite(margin):
        raise ValueError(f"margin={margin!r}: expected a finite number (a cosine threshold, usually in [-1, 1])")
    parts = split_rows(weight, "cosine_hinge")
    with no_autocast(parts.rows):
        unit, valid = unit_rows(parts, exclude_ids)
        norm = valid_count(valid, parts.group).clamp_min(1.0).square().reciprocal()  # 1/N², on the device
        population = parts.total - len(check_ids(exclude_ids, parts.total))
        if sample is None or sample >= population:
            return _HingeExact.apply(unit, valid, parts.offset, parts.total, float(margin), block, norm, parts.group)
        ids = sample_ids(parts.total, exclude_ids, sample, generator, unit.device)
        scale = norm * (population / sample)
        return _HingeSampled.apply(unit, valid, parts.offset, ids, float(margin), block, scale, parts.group)


def weight_singular_values(weight: torch.Tensor) -> torch.Tensor:
    """Singular values σ_1 ≥ … ≥ σ_d of W (V×d), float64, differentiable, from the d×d Gram
    WᵀW = Σ_shards W_rᵀW_r (`aniso_plugins.numerics.linalg.block_gram`: float32 products of row
    blocks summed in float64, then `singular_values`; docs/methods.md §4 for the precision,
    σ_k to ~1e-7·(σ_1/σ_k)² relative). The gradient is finite only where σ_k > 0 (V ≥ d, full rank)."""
    parts = split_rows(weight, "weight_singular_values")
    with no_autocast(parts.rows):
        return singular_values(global_sum(block_gram(parts.rows), parts.group))


def spectrum_penalty(
    weight: torch.Tensor,
    prior: Prior = "poly",
    c1: float | None = None,
    c2: float = 0.01,
    gamma: float = 0.75,
) -> torch.Tensor:
    """Spectrum control, Wang et al. 2020 (ICLR, §4), docs/methods.md §4, on σ = singular values of
    W sorted descending and paired with k = 1..d:

        "poly":  R = Σ_k (σ_k − c1·k^−γ)²
        "exp":   R = Σ_k (σ_k − c1·exp(−c2·k^γ))²
        "ratio": R = σ_1 / σ_d   (the condition-number penalty named in seed 000; c1, c2, γ unused)

    λ_p / λ_e of the paper is ``config.reg_weight``; the paper does not report c1, c2, γ
    (Theorem 4.1 needs γ > 1/2). σ comes from the d×d Gram (`weight_singular_values`), cost
    2Vd² flops plus an O(d³) eigh; its gradient needs σ_d > 0 (a head with V ≥ d rows and full
    rank: not a low-rank head). Implemented: the prior penalties and the ratio, applied to W
    directly. Left out: the paper's reparameterization W = UΣVᵀ with learned U, Σ, V and the
    soft orthogonality penalties λ₁‖UᵀU − I‖²_F + … (it replaces the head by three factors and
    changes what trainers and checkpoints see; the penalty on the singular values of W is the
    part that acts on the spectrum). Returns a 0-d float64 tensor."""
    if prior not in PRIORS:
        raise ValueError(f"prior={prior!r}: expected one of {', '.join(PRIORS)}")
    if prior != "ratio":
        if c1 is None or not math.isfinite(c1) or c1 <= 0:
            raise ValueError(f"c1={c1!r}: prior {prior!r} needs a number > 0 (the scale of the singular values)")
        if not math.isfinite(gamma) or gamma <= 0:
            raise ValueError(f"gamma={gamma!r}: expected a number > 0")
        if not math.isfinite(c2) or c2 < 0:
            raise ValueError(f"c2={c2!r}: expected a number >= 0")
    sigma = weight_singular_values(weight)
    if prior == "ratio":
        return sigma[0] / sigma[-1]
    k = torch.arange(1, sigma.numel() + 1, dtype=torch.float64, device=sigma.device)
    target = c1 * k.pow(-gamma) if prior == "poly" else c1 * torch.exp(-c2 * k.pow(gamma))
    return (sigma - target).square().sum()


__all__ = ["PRIORS", "cosine_hinge", "cosreg", "spectrum_penalty", "weight_singular_values"]
