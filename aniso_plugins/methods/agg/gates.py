"""AGG: adaptive gradient gating of rare-token embeddings (Yu et al., ACL 2022; docs/methods.md §1).

This module computes AGG's gates from the token appearance (`agg_gates`): which ids are rare and
by how much each part of a rare id's output-side gradient is scaled. They are `RowGates`, which
the training head applies to the weight gradient without an N×V pass
(`aniso_plugins.methods.fused_loss.linear.gated_linear`, or fused with the cross-entropy in
`aniso_plugins.methods.fused_loss.cross_entropy.fused_linear_cross_entropy`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from aniso_plugins.methods.fused_loss.row_gates import RowGates

__all__ = ["G2_EPS", "agg_gates", "rare_fraction_alpha"]

#: The official code's guard on the mean rare count: g2 = min(c_k / (c̄_r + 1e-7), 1).
G2_EPS = 1e-7


def agg_gates(
    appearance: torch.Tensor,
    alpha: float | torch.Tensor,
    *,
    steps: int = 1,
    g1: bool = True,
    g2: bool = True,
    parts: Iterable[str] = ("b", "c"),
    freeze_rare: bool = False,
) -> RowGates:
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
    if isinstance(alpha, torch.Tensor):  # computed on the device (rare_fraction): > 0 by construction, not read
        if alpha.numel() != 1 or not alpha.dtype.is_floating_point:
            raise ValueError(f"alpha: expected a 0-dim float tensor, got {alpha.dtype} {tuple(alpha.shape)}")
    elif not (isinstance(alpha, (int, float)) and alpha > 0):
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
    return RowGates(gate1, gate2, rare, target)


def rare_fraction_alpha(
    counts: torch.Tensor, appearance: torch.Tensor, fraction: float, special_ids: Iterable[int] | torch.Tensor = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """α for which the rare group {k : a_k < α} holds about `fraction` of the window's target
    tokens (docs/methods.md §1.2, ``rare_fraction``), and the share it holds: two 0-dim tensors
    on the counts' device, computed there (sort, cumsum, argmin: no host read).

    counts: c, the window's target counts (V,); appearance: a, the values `agg_gates` compares
    (a_k = s·c_k for every id but the specials, s > 0: per update or per ``alpha_tokens``);
    special_ids: never rare (distinct ids), their tokens count in the total. The group is a count threshold:
    {k non-special : c_k < θ}, with θ ranging over the distinct counts of the non-special ids
    (and above the largest). Ids never seen are rare for every α > 0. Of these groups the one
    whose share Σ_{k rare} c_k / Σ_j c_j is nearest `fraction` is taken (the smaller on a tie),
    and α = a_k of the least frequent id left out of it (ties in a_k go together), so the strict
    test a_k < α selects exactly that group in float32. With nothing counted, (the smallest
    positive float32, 0): only never-seen ids are rare.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction={fraction!r}: expected a number in (0, 1)")
    if counts.shape != appearance.shape or counts.dim() != 1:
        shapes = f"counts {tuple(counts.shape)} and appearance {tuple(appearance.shape)}"
        raise ValueError(f"{shapes}: expected two (V,) tensors")
    device, v = counts.device, counts.numel()
    special = torch.zeros(v, dtype=torch.bool, device=device)
    ids = special_ids if isinstance(special_ids, torch.Tensor) else torch.tensor(list(dict.fromkeys(special_ids)), dtype=torch.int64)
    special[ids.to(device)] = True
    c = counts.to(torch.int64)
    a = appearance.to(torch.float32)
    total, others = c.sum(), v - ids.numel()  # the specials sort last, after the N = `others` ids that can be rare
    order = torch.sort(torch.where(special, torch.iinfo(torch.int64).max, c), stable=True).indices
    ordered, a_ordered = torch.where(special, 0, c)[order], a[order]
    share = torch.cat([ordered.new_zeros(1), ordered.cumsum(0)]).double() / total.clamp_min(1)  # [i]: the i least frequent
    i = torch.arange(v + 1, device=device)
    allowed = (i <= others) & (i >= (ordered[:others] == 0).sum())  # a group ends where the count changes,
    allowed[1:others] &= ordered[1:others] != ordered[: others - 1]  # never-seen ids always rare (α > 0)
    chosen = torch.where(allowed, (share - fraction).abs(), torch.inf).argmin()  # the first of the nearest
    tiny = torch.finfo(torch.float32).tiny
    largest = torch.nextafter(a_ordered[max(others - 1, 0)], torch.tensor(torch.inf, device=device))
    left_out = a_ordered.index_select(0, chosen.clamp(max=max(others - 1, 0)).reshape(1))[0]  # (a tensor index: no read)
    alpha = torch.where(chosen < others, left_out, largest)  # every id rare: above them all
    alpha = torch.where((total == 0) | (others == 0), tiny, alpha.clamp_min(tiny))
    held = torch.where(~special & (a < alpha), c, 0).sum().double() / total.clamp_min(1)
    return alpha, held
