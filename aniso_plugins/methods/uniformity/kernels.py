"""Alignment and uniformity (Wang & Isola, ICML 2020, "Understanding Contrastive Representation
Learning through Alignment and Uniformity on the Hypersphere"), docs/methods.md §13.

On unit-normalised vectors x̂ = x / ‖x‖:

    L_uniform(X) = log  mean_{i≠j} exp(−t ‖x̂_i − x̂_j‖²)          (paper: t = 2)
    L_align(X, Y) = mean_i ‖x̂_i − ŷ_i‖^α                          (paper: α = 2)

for pairs (x_i, y_i) of views of the same input. ‖x̂_i − x̂_j‖² = 2 − 2 x̂_i·x̂_j. Lower is more
uniform (resp. better aligned); L_uniform ≥ −2t, reached only in the limit of infinitely many
points spread over the sphere. The paper's code takes the mean over pairs i < j (``torch.pdist``),
which equals the mean over ordered pairs i ≠ j used here.

- `uniformity` / `alignment`: exact, dense (O(n²) memory), for small sets (SimCSE batches).
- `row_uniformity`: L_uniform of the rows of a large matrix (the LM head, a micro-batch's hidden
  states) blockwise in O(block·n) memory, exact or with sampled rows, on a full tensor or an
  FSDP2 row shard, with the gradient computed in the forward (docs/methods.md §13.1).
- `pair_logsumexp`, `uniformity_stats`, `uniformity_finish`: the metric's reducible pieces.

Numerics: exponents a_ij = −t‖x̂_i − x̂_j‖² = 2t(x̂_i·x̂_j − 1) are formed in float32 (float64 for
float64 input, autocast off) and summed as exp(a_ij − m)·e^m with a running maximum m, so that
no exp underflows to an empty sum for any t (the log-sum-exp of blocks, combined); sums are
accumulated in float64. The training terms read nothing back to the host (docs/performance.md
§5.8): N < 2 and an empty sum are `torch.where`s, the pairs j = i are diagonals placed from the
row partition, the sampled rows are gathered under a mask.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from aniso_plugins.numerics.distributed import ceil_div
from aniso_plugins.numerics.reduce import Stat
from aniso_plugins.numerics.rows import (
    GradientInForward,
    Rows,
    check_ids,
    column_block,
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

_NEG_INF = -math.inf


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)


def uniformity(x: torch.Tensor, t: float = 2.0) -> torch.Tensor:
    """L_uniform of the rows of `x` (n × d, n ≥ 2), exact over all ordered pairs i ≠ j, computed
    in float32 or wider (float64 in, float64 out). Differentiable; memory O(n²)."""
    if x.dim() != 2 or x.shape[0] < 2:
        raise ValueError(f"uniformity: expected an (n, d) tensor with n >= 2, got shape {tuple(x.shape)}")
    u = _unit(x if x.dtype == torch.float64 else x.float())
    n = u.shape[0]
    sq = (2.0 - 2.0 * (u @ u.T)).clamp_min(0.0)
    off = ~torch.eye(n, dtype=torch.bool, device=u.device)
    return torch.logsumexp(-t * sq[off], dim=0) - math.log(n * (n - 1))


def alignment(x: torch.Tensor, y: torch.Tensor, alpha: float = 2.0) -> torch.Tensor:
    """L_align of the pairs (x_i, y_i), rows of two (n × d) tensors; float32 or wider."""
    if x.shape != y.shape or x.dim() != 2:
        raise ValueError(f"alignment: expected two (n, d) tensors of one shape, got {tuple(x.shape)} and {tuple(y.shape)}")
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (_unit(x.to(dt)) - _unit(y.to(dt))).norm(dim=-1).pow(alpha).mean()


# --- blockwise kernel ---------------------------------------------------------------------------


class _RunningSum:
    """Σ exp(a) over blocks of exponents a, held as e^shift · total (shift: the running maximum,
    −inf while nothing was summed). `add` returns exp(a − shift) for the block and the factor by
    which sums accumulated so far (gradients) must be rescaled."""

    def __init__(self, like: torch.Tensor) -> None:
        self.shift = torch.full((), _NEG_INF, dtype=like.dtype, device=like.device)
        self.total = torch.zeros((), dtype=torch.float64, device=like.device)

    def add(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new = torch.maximum(self.shift, a.max()) if a.numel() else self.shift
        safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))  # all −inf so far: exp(a − 0) = 0
        factor = torch.exp(self.shift - safe)  # 0 while the sum is empty
        weights = a.sub_(safe).exp_()
        self.total = self.total * factor.double() + weights.sum(dtype=torch.float64)
        self.shift = new
        return weights, factor

    def log_total(self, group: dist.ProcessGroup | None) -> torch.Tensor:
        """log Σ over every rank of `group` (float64, 0-d, identical on every rank; −inf if empty)."""
        shift = self.shift.double()
        top = shift.clone()
        if group is not None:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # nothing summed: total 0, log −inf
        total = self.total * torch.exp(shift - top)
        if group is not None:
            dist.all_reduce(total, group=group)
        return top + total.log()

    def weight(self, log_total: torch.Tensor) -> torch.Tensor:
        """exp(shift − log Σ): turns this rank's accumulated exp(a − shift) into exp(a)/Σ; 0 when
        the sum is empty (log Σ = −inf), so that an unused gradient stays finite."""
        ratio = torch.exp(self.shift.double() - log_total)
        return torch.where(torch.isfinite(log_total), ratio, torch.zeros_like(ratio)).to(self.shift.dtype)


def _exponents(left: torch.Tensor, right: torch.Tensor, t: float, left_valid, right_valid) -> torch.Tensor:
    """a_ij = 2t(û_i·û_j − 1) = −t‖û_i − û_j‖², −inf where a row or a column is not valid."""
    a = (left @ right.T).sub_(1.0).mul_(2.0 * t)
    a.masked_fill_(~left_valid.unsqueeze(1), _NEG_INF)
    return a.masked_fill_(~right_valid.unsqueeze(0), _NEG_INF)


def _exact_sums(
    unit: torch.Tensor,
    valid: torch.Tensor,
    columns: Iterable[tuple[torch.Tensor, list[tuple[int, int, int]]]],
    t: float,
    want_grad: bool,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log Σ over the local rows i and every column j ≠ i of exp(a_ij), summed over the ranks of
    `group`; and, if `want_grad`, its gradient w.r.t. the local û_i, 4t Σ_j exp(a_ij)/Σ · û_j
    (both orders of each pair; a_ij is symmetric). `columns` yields (flagged column rows
    [û | valid], the diagonal segments where a column is the row itself: `own_diagonal`)."""
    d = unit.shape[1]
    acc = _RunningSum(unit)
    grad = torch.zeros_like(unit) if want_grad else None
    for cols, own in columns:
        a = mask_diagonal(_exponents(unit, cols[:, :d], t, valid, cols[:, d] > 0), own, _NEG_INF)  # j ≠ i
        weights, factor = acc.add(a)
        if grad is not None:
            grad.mul_(factor).addmm_(weights, cols[:, :d])
    log_total = acc.log_total(group)
    if grad is not None:
        grad.mul_(acc.weight(log_total) * (4.0 * t))
    return log_total, grad


def _flagged(unit: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.cat([unit, valid.unsqueeze(1).to(unit.dtype)], 1)


class _ExactLogSum(GradientInForward):
    """log Σ_{i≠j valid} exp(−t‖û_i − û_j‖²) over all rows of all ranks, blockwise."""

    @staticmethod
    def forward(ctx, unit, valid, offset, total, t, block, group):
        world = 1 if group is None else dist.get_world_size(group)
        flagged = _flagged(unit, valid)
        rounds = ceil_div(ceil_div(total, world), block)  # blocks of the largest shard
        columns = (
            (
                column_block(flagged, k * block, block, total, group)[0],
                own_diagonal(offset, len(unit), k * block, block, total, group),
            )
            for k in range(rounds)
        )
        log_total, grad = _exact_sums(unit, valid, columns, t, ctx.needs_input_grad[0], group)
        if grad is not None:
            ctx.save_for_backward(grad)
        return log_total


class _SampledLogSum(GradientInForward):
    """log Σ_{i∈S valid} Σ_{j≠i valid} exp(−t‖û_i − û_j‖²) for the sampled rows S (global ids)
    against every row; gradient through the sampled rows and through every row j."""

    @staticmethod
    def forward(ctx, unit, valid, offset, sample_ids, t, block, group):
        n, d = unit.shape
        own = sample_ids - offset
        mine = (own >= 0) & (own < n)
        rows = gather_sampled(_flagged(unit, valid), own, mine, group)
        want_grad = ctx.needs_input_grad[0]
        acc = _RunningSum(unit)
        grad = torch.zeros_like(unit) if want_grad else None
        row_grad = torch.zeros(len(sample_ids), d, dtype=unit.dtype, device=unit.device) if want_grad else None
        for b in range(0, len(sample_ids), block):
            ru = rows[b : b + block, :d]
            a = _exponents(ru, unit, t, rows[b : b + block, d] > 0, valid)
            mask_own(a, own[b : b + block], mine[b : b + block], _NEG_INF)  # j = i
            weights, factor = acc.add(a)
            if want_grad:
                grad.mul_(factor).addmm_(weights.T, ru)
                row_grad.mul_(factor)[b : b + block] = weights @ unit
        log_total = acc.log_total(group)
        if want_grad:
            scale = acc.weight(log_total) * (2.0 * t)  # 0 without a sampled pair: the caller returns 0
            grad.mul_(scale)
            row_grad.mul_(scale)
            if group is not None:
                dist.all_reduce(row_grad, group=group)
            if n:
                grad.index_add_(0, own.clamp(0, n - 1), torch.where(mine.unsqueeze(1), row_grad, 0.0))
            ctx.save_for_backward(grad)
        return log_total


def _check_block(block: object) -> None:
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"block={block!r}: expected an integer >= 1 (rows per block)")


def _check_t(t: object) -> None:
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not (math.isfinite(t) and t > 0):
        raise ValueError(f"t={t!r}: expected a finite number > 0 (paper: 2)")


def row_uniformity(
    weight: torch.Tensor,
    t: float = 2.0,
    *,
    block: int = 1024,
    sample: int | None = None,
    generator: torch.Generator | None = None,
    exclude_ids: Sequence[int] = (),
) -> torch.Tensor:
    """L_uniform of the rows of `weight` (V × d), docs/methods.md §13.1:

        L = log( 1/(N(N−1)) · Σ_i Σ_{j≠i} exp(−t‖ŵ_i − ŵ_j‖²) ),

    over the N valid rows (norm > 0, not in `exclude_ids`); 0 (with a zero gradient, still
    connected to `weight`) when N < 2. A differentiable 0-d float64 tensor.

    Exact mode (``sample=None``): `block` rows at a time, extra memory O(block·V), 4V²d flops
    for value and gradient (computed in the forward: ∂L/∂ŵ_i = 4t Σ_j p_ij ŵ_j with
    p_ij = exp(−t‖ŵ_i − ŵ_j‖²)/Σ, then autograd through the normalisation).

    Sampled mode (``sample=s``): rows S = P[torch.randperm(|P|, generator=generator)[:s]], P the
    ids not in `exclude_ids` in increasing order (pass a generator seeded identically on every
    rank); L̂ = log( |P|/s · 1/(N(N−1)) Σ_{i∈S} Σ_{j≠i} exp(−t‖ŵ_i − ŵ_j‖²) ): the pair mean
    inside the log is unbiased, L̂ itself is biased low by Jensen's inequality (E L̂ ≤ L).
    Cost 6·s·V·d flops, memory O(block·V). ``sample >= |P|`` is exact; 0 with a zero gradient
    when no sampled row has a valid partner.

    `weight` may be a plain tensor (single process, DDP replica, FSDP2's unsharded weight inside
    the forward: computed in full on every rank) or an FSDP2 ``Shard(0)`` DTensor (local rows,
    `block` rows per rank all-gathered per round; the value is the global one on every rank and
    the local gradient is its rows of the global gradient), like
    `aniso_plugins.methods.regularizers.penalties.cosine_hinge`."""
    _check_block(block)
    _check_t(t)
    if sample is not None and (not isinstance(sample, int) or isinstance(sample, bool) or sample < 1):
        raise ValueError(f"sample={sample!r}: expected None (exact) or an integer >= 1 (rows per step)")
    parts = split_rows(weight, "row_uniformity")
    with no_autocast(parts.rows):
        unit, valid = unit_rows(parts, exclude_ids)
        n = valid_count(valid, parts.group)  # on the device: no host read, N < 2 is a where
        zero = unit.sum(dtype=torch.float64) * 0.0
        log_pairs = torch.log(n * (n - 1))
        population = parts.total - len(check_ids(exclude_ids, parts.total))
        if sample is None or sample >= population:
            log_total = _ExactLogSum.apply(unit, valid, parts.offset, parts.total, float(t), block, parts.group)
        else:
            ids = sample_ids(parts.total, exclude_ids, sample, generator, unit.device)
            log_total = _SampledLogSum.apply(unit, valid, parts.offset, ids, float(t), block, parts.group)
            log_pairs = log_pairs - math.log(population / sample)
        # no valid pair (N < 2, or no sampled row with a partner): 0, and the kernels' gradient is 0
        return torch.where((n >= 2) & torch.isfinite(log_total), log_total - log_pairs, zero)


# --- metric pieces --------------------------------------------------------------------------------


def pair_logsumexp(
    x: torch.Tensor, t: float = 2.0, block: int = 1024, rows: slice | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log Σ exp(−t‖x̂_i − x̂_j‖²), number of pairs) over the ordered pairs i ≠ j of nonzero rows
    of `x` (n × d, a plain tensor) whose first row i lies in ``x[rows]`` (all rows when None:
    a rank's share of a matrix every rank holds; shares combine by log-sum-exp and by sum).
    float64, `block` columns at a time (memory O(block·n)), no gradient; (−inf, 0) without pairs,
    a NaN sum when `x` has a non-finite entry."""
    _check_block(block)
    _check_t(t)
    with torch.no_grad(), no_autocast(x):
        full = x.detach().to(torch.float64)
        unit, valid = unit_rows(Rows(full, 0, full.shape[0], None), ())
        lo, hi, _ = (rows or slice(None)).indices(full.shape[0])
        flagged = _flagged(unit, valid)
        columns = (
            (flagged[s : s + block], own_diagonal(lo, hi - lo, s, block, len(full), None)) for s in range(0, len(full), block)
        )
        log_total, _ = _exact_sums(unit[lo:hi], valid[lo:hi], columns, float(t), False, None)
        # a NaN row would otherwise drop out as a zero row (decided on the device: no host read)
        log_total = torch.where(torch.isfinite(full).all(), log_total, math.nan)
        pairs = valid[lo:hi].sum(dtype=torch.float64) * (valid.sum(dtype=torch.float64) - 1).clamp_min(0)
        return log_total, pairs


def uniformity_stats(
    x: torch.Tensor, t: float = 2.0, prefix: str = "", block: int = 1024, rows: slice | None = None
) -> dict[str, Stat]:
    """This rank's pieces of L_uniform (`pair_logsumexp` of `x`, first rows in `rows`):
    ``pair_lse`` (op "lse") and ``pairs`` (op "sum"). Reduced over ranks they give L_uniform
    over all the ranks' pairs, exactly (`uniformity_finish`)."""
    lse, pairs = pair_logsumexp(x, t, block, rows)
    return {f"{prefix}pair_lse": Stat(lse, "lse"), f"{prefix}pairs": Stat(pairs)}


def uniformity_finish(reduced: Mapping[str, torch.Tensor], prefix: str = "") -> float:
    """log(Σ exp(−t‖x̂_i − x̂_j‖²) / #pairs) from reduced `uniformity_stats`; NaN when there is
    no pair or the value is not finite."""
    pairs = float(reduced[f"{prefix}pairs"])
    value = float(reduced[f"{prefix}pair_lse"]) - math.log(pairs) if pairs > 0 else math.nan
    return value if math.isfinite(value) else math.nan


__all__ = ["alignment", "pair_logsumexp", "row_uniformity", "uniformity", "uniformity_finish", "uniformity_stats"]
