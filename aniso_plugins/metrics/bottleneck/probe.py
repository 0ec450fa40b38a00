"""The LM-head gradient bottleneck (Godey & Artzi 2026, "Lost in Backpropagation"; seed 001;
docs/methods.md §9, docs/performance.md §5.6).

For a position i with hidden state h_i, logits z_i = W h_i (W: V×d) and target y_i, the logit
gradient is g_i = softmax(z_i) − e_{y_i}. The backbone only receives dh_i = Wᵀ g_i, so the part
of g_i in ker(Wᵀ) is lost; with P the orthogonal projector onto col(W):

    ‖P g_i‖² = dh_iᵀ (WᵀW)⁺ dh_i

so everything follows from the head-input gradient dh_i and the d×d Gram WᵀW: one
eigen-decomposition, no projector, nothing V×V. Metrics (names as returned):

- ``lost_fraction``: pooled and squared, ℓ² = 1 − Σ_i ‖P g_i‖² / Σ_i ‖g_i‖² = 1 − ‖PG‖²_F/‖G‖²_F (G
  the stacked logit gradients); ≈ 1 − d/V at random initialisation (docs/methods.md §9.2);
- ``lost_fraction_norm``: ℓ = √ℓ² = ‖(I − P)G‖_F / ‖G‖_F (the norm, not squared, variant);
- ``kept_cosine``: token mean of cos(g_i, P g_i) = ‖P g_i‖ / ‖g_i‖ (the seed's "cosine similarity
  between the logit gradient and its projection", Fig. 4b);
- ``lost_fraction_token``: token mean of 1 − ‖P g_i‖²/‖g_i‖² (differs from the pooled value);
- ``tokens``: positions counted.

Which of these is the paper's Equation 1 is not checked (docs/methods.md §9.1): report them by name.

**Update efficiency** (the paper's §3.4 / Fig. 6; docs/methods.md §9.5): on k sampled positions
with logits Z (k×V), targets y and logit gradient G (rows ∝ g_i), the logit change that moving
the hidden states along their gradient produces is P = (G W) Wᵀ = ∇_H · Wᵀ. For a budget ε,

    Z_L = Z − ε‖Z‖_F · G/‖G‖_F,   Z_H = Z − ε‖Z‖_F · P/‖P‖_F

and, with L the mean cross-entropy over the positions, ``decrease_logits`` = L(Z) − L(Z_L),
``decrease_hidden`` = L(Z) − L(Z_H), ``ratio`` = decrease_hidden / decrease_logits, and
``cos`` = ⟨G, P⟩_F / (‖G‖_F ‖P‖_F) ≤ √(1 − ``lost_fraction``) (Cauchy–Schwarz: P lies in col(W)),
with equality when WᵀW = c·I. As ε → 0 the ratio tends to ``cos``. Statistics pool over ranks in
two rounds: norms and the base loss (`update_efficiency_stats`), then the perturbed losses from
the reduced norms (`update_efficiency_loss_stats`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import torch

from aniso_plugins.numerics.linalg import ROW_BLOCK, eigh_gram, gram_stats_blocked
from aniso_plugins.numerics.reduce import Stat

LOGIT_ELEMENTS = 1 << 22
"""Logit entries (tokens × V) materialised at a time by `gradient_bottleneck`."""


def squared_row_norms(grad: torch.Tensor, block_rows: int = ROW_BLOCK) -> torch.Tensor:
    """‖g_i‖² of every row of an (N, V) logit gradient, as float64: a vector norm accumulated in
    float32 (float64 for float64 input; bf16/fp16 upcast one block of rows at a time), relative
    error ~1e-6 at V = 50k, squared in float64."""
    dtype = torch.promote_types(grad.dtype, torch.float32)
    blocks = [torch.linalg.vector_norm(b, dim=1, dtype=dtype).to(torch.float64) for b in grad.split(block_rows)]
    return torch.cat(blocks).square() if blocks else torch.zeros(0, dtype=torch.float64, device=grad.device)


def bottleneck_stats(
    dh: torch.Tensor, grad_sq: torch.Tensor, gram: torch.Tensor, prefix: str = ""
) -> dict[str, Stat]:
    """Reducible sums of the bottleneck metrics from what the head's backward provides.

    dh: (N, d) gradients at the head input, c·Wᵀg_i; grad_sq: (N,) ‖c·g_i‖², the squared norms
    of the gradients at the head output with the same scale c (any loss scaling, mean
    reduction or accumulation factor cancels); gram: the full d×d WᵀW (reduced across ranks).
    Positions with ‖g_i‖ = 0 (ignored targets) are skipped. (WᵀW)⁺ keeps the eigenvalues above
    d·ε·λ_max (`aniso_plugins.numerics.linalg.eigh_gram`); per-position ratios are clipped to [0, 1]
    against round-off. Keys: grad_sq, kept_sq, kept_ratio, kept_cosine (sums), tokens."""
    if dh.dim() != 2 or grad_sq.shape != dh.shape[:1]:
        raise ValueError(
            f"dh must be (N, d) and grad_sq (N,), got dh {tuple(dh.shape)} and grad_sq {tuple(grad_sq.shape)}"
        )
    if gram.shape != (dh.shape[1], dh.shape[1]):
        raise ValueError(f"gram must be ({dh.shape[1]}, {dh.shape[1]}), got {tuple(gram.shape)}")
    lam, vec = eigh_gram(gram)
    inv = torch.where(lam > 0, 1.0 / lam.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    keep = grad_sq > 0  # the probed tokens; the others weigh 0 (no row selected: no host read)
    g2 = torch.where(keep, grad_sq.to(torch.float64), 0.0)
    coef = dh.to(device=vec.device, dtype=torch.float64) @ vec
    kept = torch.where(keep, (coef.square() * inv).sum(1).to(g2.device), 0.0)
    ratio = torch.where(keep, kept / torch.where(keep, g2, 1.0), 0.0).clamp(0.0, 1.0)
    return {
        f"{prefix}grad_sq": Stat(g2.sum()),
        f"{prefix}kept_sq": Stat(torch.minimum(kept, g2).sum()),
        f"{prefix}kept_ratio": Stat(ratio.sum()),
        f"{prefix}kept_cosine": Stat(ratio.sqrt().sum()),
        f"{prefix}tokens": Stat(keep.sum(dtype=torch.float64)),
    }


def bottleneck_finish(reduced: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, float]:
    """The metrics of the module docstring from reduced `bottleneck_stats` (NaN without tokens)."""
    n = float(reduced[f"{prefix}tokens"])
    total = float(reduced[f"{prefix}grad_sq"])
    if n == 0 or total == 0:
        names = ("lost_fraction", "lost_fraction_norm", "kept_cosine", "lost_fraction_token")
        return {**dict.fromkeys(names, math.nan), "tokens": n}
    lost = min(max(1.0 - float(reduced[f"{prefix}kept_sq"]) / total, 0.0), 1.0)
    return {
        "lost_fraction": lost,
        "lost_fraction_norm": math.sqrt(lost),
        "kept_cosine": float(reduced[f"{prefix}kept_cosine"]) / n,
        "lost_fraction_token": 1.0 - float(reduced[f"{prefix}kept_ratio"]) / n,
        "tokens": n,
    }


def _check_head(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):
        raise TypeError("weight: expected the full (V, d) head matrix as a plain tensor, got a DTensor")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a (V, d) tensor, got {getattr(weight, 'shape', type(weight).__name__)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden has last dimension {hidden.shape[-1]}, the weight has d={weight.shape[1]}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal hidden.shape[:-1] = {tuple(hidden.shape[:-1])}"
        )


def logit_gradients(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield blocks (h, g) of hidden states and logit gradients g_i = softmax(W h_i) − e_{y_i}
    of the positions whose target is not `ignore_index`, at most `LOGIT_ELEMENTS` logits at a
    time, in float32 (float64 if an input is float64)."""
    _check_head(hidden, weight, targets)
    v = weight.shape[0]
    h = hidden.detach().reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1)
    keep = y != ignore_index
    h, y = h[keep], y[keep]
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= v):
        raise ValueError(f"targets must lie in [0, {v}) or equal ignore_index={ignore_index}")
    dtype = torch.promote_types(torch.promote_types(h.dtype, weight.dtype), torch.float32)
    w = weight.detach().to(dtype)
    step = max(1, LOGIT_ELEMENTS // v)
    for start in range(0, y.numel(), step):
        hb = h[start : start + step].to(dtype)
        g = torch.softmax(hb @ w.T, dim=-1)
        g[torch.arange(hb.shape[0], device=g.device), y[start : start + step]] -= 1.0
        yield hb, g


def gradient_bottleneck(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> dict[str, float]:
    """Lost fraction and kept cosine of the logit gradients of these positions (module
    docstring), computed from dh_i = Wᵀ g_i and the d×d Gram only.

    hidden: (..., d) head inputs; weight: the full (V, d) head matrix (a plain tensor); targets:
    (...) ids aligned with `hidden`, `ignore_index` where no loss is taken. Over the given
    positions only (no reduction across ranks; `BottleneckPlugin` pools ranks via
    `bottleneck_stats`). Logits in float32 (float64 for float64 inputs), blocks of
    `LOGIT_ELEMENTS`; Gram and solve in float64."""
    dh, grad_sq = [], []
    for _, g in logit_gradients(hidden, weight, targets, ignore_index):
        grad_sq.append(squared_row_norms(g))
        dh.append(g @ weight.detach().to(g.dtype))
    d = weight.shape[1]
    dh_all = torch.cat(dh) if dh else torch.zeros(0, d, dtype=torch.float64, device=weight.device)
    sq_all = torch.cat(grad_sq) if grad_sq else torch.zeros(0, dtype=torch.float64, device=weight.device)
    stats = bottleneck_stats(dh_all, sq_all, gram_stats_blocked(weight).gram)
    return bottleneck_finish({name: stat.value for name, stat in stats.items()})


def logit_gradient_rank(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, rtol: float = 1e-6
) -> int:
    """Empirical rank of the logit gradient G (N × V, rows g_i = softmax(W h_i) − e_{y_i}, ignored
    positions dropped): the number of singular values σ_j(G) > rtol·σ_max(G), G in float64.

    The seed (Godey & Artzi 2026, §2.4 / Fig. 7a) counts "non-null (> 1e-6) diagonal R values"
    of a QR decomposition; an unpivoted QR is not rank-revealing (docs/methods.md §9.4), so we count
    singular values instead, with a *relative* threshold (default 1e-6). Memory N·V·8 bytes."""
    if not (isinstance(rtol, float | int) and 0 < rtol < 1):
        raise ValueError(f"rtol={rtol!r}: expected a number in (0, 1)")
    blocks = [g.to(torch.float64) for _, g in logit_gradients(hidden, weight, targets, ignore_index)]
    if not blocks:
        return 0
    sigma = torch.linalg.svdvals(torch.cat(blocks))
    return int((sigma > rtol * sigma[0]).sum())


# --- update efficiency (Godey & Artzi 2026, §3.4 / Fig. 6; docs/methods.md §9.5) ---------------


def eps_key(eps: float) -> str:
    """The metric-name component of a budget ε: ``eps_`` + the shortest repr of the float
    (``eps_0.01``, ``eps_1e-05``, ``eps_1.0``), unique per value."""
    return f"eps_{float(eps)!r}"


def sample_loss_positions(
    targets: torch.Tensor, k: int, generator: torch.Generator, ignore_index: int = -100
) -> torch.Tensor:
    """Indices (ascending, int64, on the targets' device) into ``targets.reshape(-1)`` of k
    positions drawn uniformly without replacement among those whose target is not
    `ignore_index`; all of them when there are at most k. `generator` is a CPU generator."""
    if not (isinstance(k, int) and k >= 1):
        raise ValueError(f"k={k!r}: expected an integer >= 1")
    valid = (targets.reshape(-1) != ignore_index).nonzero().squeeze(1)
    if valid.numel() <= k:
        return valid
    pick = torch.randperm(valid.numel(), generator=generator)[:k].to(valid.device)
    return valid[pick].sort().values


def hidden_logit_direction(grad_hidden: torch.Tensor, weight: torch.Tensor, block_rows: int = 8192) -> torch.Tensor:
    """P = ∇_H · Wᵀ, row i = W·dh_i: the logit change of moving the head inputs along their
    gradient (`grad_hidden`, (k, d)) through the (V, d) matrix `weight`, as (k, V), in float32
    (float64 if an input is), upcasting `block_rows` rows of W at a time. 2kVd flops.
    A low-rank head W = A·B: ``hidden_logit_direction(grad_hidden @ B.T, A)``."""
    if grad_hidden.dim() != 2 or weight.dim() != 2 or grad_hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"grad_hidden must be (k, d) and weight (V, d), got {tuple(grad_hidden.shape)} and {tuple(weight.shape)}"
        )
    dtype = torch.promote_types(torch.promote_types(grad_hidden.dtype, weight.dtype), torch.float32)
    dh = grad_hidden.detach().to(device=weight.device, dtype=dtype)
    blocks = [dh @ w.detach().to(dtype).T for w in weight.split(block_rows)]
    return torch.cat(blocks, dim=1) if blocks else dh.new_zeros(dh.shape[0], 0)


def _rows_per_block(v: int) -> int:
    """Rows of a (·, V) float64 temporary that hold `LOGIT_ELEMENTS` entries."""
    return max(1, LOGIT_ELEMENTS // max(v, 1))


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Σ_i (logsumexp(z_i) − z_{i,y_i}) over the rows of (k, V) `logits`, in float64 (0-d),
    `LOGIT_ELEMENTS` entries at a time."""
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    rows = _rows_per_block(logits.shape[-1])
    for z, y in zip(logits.split(rows), targets.split(rows)):
        z = z.to(torch.float64)
        total = total + (torch.logsumexp(z, dim=1) - z.gather(1, y.reshape(-1, 1).to(z.device)).squeeze(1)).sum()
    return total


def _check_rows(logits: torch.Tensor, grad: torch.Tensor, direction: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.dim() != 2 or grad.shape != logits.shape or direction.shape != logits.shape:
        raise ValueError(
            "logits, grad and direction must all be (k, V), got "
            f"{tuple(logits.shape)}, {tuple(grad.shape)} and {tuple(direction.shape)}"
        )
    if targets.shape != logits.shape[:1]:
        raise ValueError(f"targets must be (k,) = ({logits.shape[0]},), got {tuple(targets.shape)}")


def _inner(a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """Σ a·b (b None: ‖a‖²) over all entries of (k, V) tensors as a float64 0-d tensor, computed
    in float32 (float64 if an input is) with torch's cascade summation: relative error ~1e-6."""
    dtype = torch.promote_types(a.dtype, torch.float32 if b is None else torch.promote_types(b.dtype, torch.float32))
    if b is None:
        return torch.linalg.vector_norm(a, dtype=dtype).to(torch.float64).square()
    return (a.to(dtype) * b.to(dtype)).sum().to(torch.float64)


def update_efficiency_stats(
    logits: torch.Tensor, grad: torch.Tensor, direction: torch.Tensor, targets: torch.Tensor, prefix: str = ""
) -> dict[str, Stat]:
    """Round 0 of the update-efficiency probe: reducible sums of this rank's k sampled positions.

    logits: (k, V) Z; grad: (k, V) G, logit gradients with one positive scale; direction: (k, V)
    P = ∇_H · Wᵀ (`hidden_logit_direction`) with the same scale; targets: (k,) ids. Keys:
    logits_sq ‖Z‖², grad_sq ‖G‖², direction_sq ‖P‖², inner ⟨G, P⟩, loss Σ CE(Z), tokens k."""
    _check_rows(logits, grad, direction, targets)
    f64 = {"dtype": torch.float64, "device": logits.device}
    return {
        f"{prefix}logits_sq": Stat(_inner(logits)),
        f"{prefix}grad_sq": Stat(_inner(grad)),
        f"{prefix}direction_sq": Stat(_inner(direction)),
        f"{prefix}inner": Stat(_inner(grad, direction)),
        f"{prefix}loss": Stat(cross_entropy_sum(logits, targets)),
        f"{prefix}tokens": Stat(torch.tensor(float(logits.shape[0]), **f64)),
    }


def _step(reduced: Mapping[str, torch.Tensor], prefix: str, name: str) -> float:
    """‖Z‖_F / ‖X‖_F from the reduced squared norms (NaN when ‖X‖ = 0 or not finite)."""
    z, x = float(reduced[f"{prefix}logits_sq"]), float(reduced[f"{prefix}{name}_sq"])
    return math.sqrt(z / x) if x > 0 and math.isfinite(x) and math.isfinite(z) else math.nan


def update_efficiency_loss_stats(
    logits: torch.Tensor,
    grad: torch.Tensor,
    direction: torch.Tensor,
    targets: torch.Tensor,
    eps: Sequence[float],
    reduced: Mapping[str, torch.Tensor],
    prefix: str = "",
) -> dict[str, Stat]:
    """Round 1: for each ε, Σ CE(Z − ε‖Z‖·G/‖G‖) (``<eps_key>/loss_logits``) and
    Σ CE(Z − ε‖Z‖·P/‖P‖) (``<eps_key>/loss_hidden``) over this rank's positions, the Frobenius
    norms pooled over all ranks (`reduced`: the reduced round-0 `update_efficiency_stats`).
    Perturbed logits in float64; NaN when a norm is 0."""
    _check_rows(logits, grad, direction, targets)
    steps = {
        "logits": (grad, _step(reduced, prefix, "grad")),
        "hidden": (direction, _step(reduced, prefix, "direction")),
    }
    names = [(f"{prefix}{eps_key(e)}/loss_{name}", float(e), name) for e in eps for name in steps]
    totals = {key: torch.zeros((), dtype=torch.float64, device=logits.device) for key, _, _ in names}
    rows = _rows_per_block(logits.shape[-1])
    blocks = zip(logits.split(rows), grad.split(rows), direction.split(rows), targets.split(rows))
    for z, g, p, y in blocks:  # one float64 copy of each block, perturbed for every (ε, direction)
        z, moves = z.to(torch.float64), {"logits": g.to(torch.float64), "hidden": p.to(torch.float64)}
        for key, e, name in names:
            totals[key] += cross_entropy_sum(torch.add(z, moves[name], alpha=-e * steps[name][1]), y)
    return {key: Stat(total) for key, total in totals.items()}


def update_efficiency_finish(
    reduced: Mapping[str, torch.Tensor], eps: Sequence[float], prefix: str = ""
) -> dict[str, float]:
    """The metrics from the reduced round-0 and round-1 statistics: loss (L(Z), the mean CE),
    per ε ``<eps_key>/decrease_logits``, ``/decrease_hidden``, ``/ratio``, then cos and tokens.
    NaN without tokens, for a zero norm, or where an input is not finite."""
    n = float(reduced[f"{prefix}tokens"])
    if n == 0:
        per_eps = ("decrease_logits", "decrease_hidden", "ratio")
        names = ["loss", "cos"] + [f"{eps_key(e)}/{m}" for e in eps for m in per_eps]
        return {**dict.fromkeys(names, math.nan), "tokens": 0.0}
    base = float(reduced[f"{prefix}loss"]) / n
    out = {"loss": base}
    for e in eps:
        key = eps_key(e)
        dl = base - float(reduced[f"{prefix}{key}/loss_logits"]) / n
        dh = base - float(reduced[f"{prefix}{key}/loss_hidden"]) / n
        out[f"{key}/decrease_logits"] = dl
        out[f"{key}/decrease_hidden"] = dh
        out[f"{key}/ratio"] = dh / dl if dl != 0 else math.nan
    g, p = float(reduced[f"{prefix}grad_sq"]), float(reduced[f"{prefix}direction_sq"])
    out["cos"] = float(reduced[f"{prefix}inner"]) / math.sqrt(g * p) if g > 0 and p > 0 else math.nan
    out = {k: v if math.isfinite(v) else math.nan for k, v in out.items()}
    return {**out, "tokens": n}


def update_efficiency(
    logits: torch.Tensor, grad: torch.Tensor, direction: torch.Tensor, targets: torch.Tensor, eps: Sequence[float]
) -> dict[str, float]:
    """`update_efficiency_finish` of these positions alone (one process, no reduction):
    logits / grad / direction (k, V), targets (k,) as for `update_efficiency_stats`."""
    reduced = {k: s.value for k, s in update_efficiency_stats(logits, grad, direction, targets).items()}
    stats = update_efficiency_loss_stats(logits, grad, direction, targets, eps, reduced)
    return update_efficiency_finish({**reduced, **{k: s.value for k, s in stats.items()}}, eps)


__all__ = [
    "LOGIT_ELEMENTS",
    "bottleneck_finish",
    "bottleneck_stats",
    "cross_entropy_sum",
    "eps_key",
    "gradient_bottleneck",
    "hidden_logit_direction",
    "logit_gradient_rank",
    "logit_gradients",
    "sample_loss_positions",
    "squared_row_norms",
    "update_efficiency",
    "update_efficiency_finish",
    "update_efficiency_loss_stats",
    "update_efficiency_stats",
]
