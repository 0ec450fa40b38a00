"""The unembedding indicator of under-trained tokens (Land & Bartolo 2024, "Fishing for
Magikarp", §3.2), as reducible statistics so it runs on sharded heads (docs/methods.md §12).

With U the (V, d) head, c₁ the first principal direction of U (the top eigenvector of the
centred Gram, float64) and P = I − c₁c₁ᵀ:

    r = P · mean_{j∈R} u_j,      score_i = cos(P u_i, r),

R the reference tokens (known unused). A token whose score is at least the threshold τ points
where the unused tokens point once the direction shared by every row is removed: its row has
barely moved from where training left the rows it never pushed up. Two rounds: round 0 sums
the Gram, the row sum, V, Σ_{j∈R} u_j and |R|; round 1 counts and sums the scores of this
rank's rows inside and outside R.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from aniso_plugins.metrics.geometry.stats import BLOCK_ROWS, moment_stats, moments
from aniso_plugins.numerics.linalg import covariance, eigh_gram
from aniso_plugins.numerics.reduce import Stat, reduce_stats

Reduced = Mapping[str, torch.Tensor]


def reference_stats(rows: torch.Tensor, reference: torch.Tensor, prefix: str = "",
                    gram_rows: torch.Tensor | None = None) -> dict[str, Stat]:
    """Round 0 of this rank's `rows` (V_local, d), `reference` the (V_local,) bool mask of R:
    `moment_stats` (of the rows in the bool mask `gram_rows` only, a uniform sample that
    estimates c₁ where an exact Gram is too costly) and Σ_{j∈R} u_j, |R| (keys
    ``reference_sum``, ``reference_count``, always over every row)."""
    total = torch.zeros(rows.shape[1], dtype=torch.float64, device=rows.device)
    for block, kept in zip(rows.split(BLOCK_ROWS), reference.split(BLOCK_ROWS)):  # R's rows by their weight 1 (no host read)
        total += kept.to(torch.float64) @ block.to(torch.float64)
    return moment_stats(rows if gram_rows is None else rows[gram_rows], prefix) | {
        prefix + "reference_sum": Stat(total),
        prefix + "reference_count": Stat(reference.sum(dtype=torch.float64)),
    }


def directions(reduced: Reduced, prefix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """(c₁, r̂): the first principal direction and the unit reference direction P·mean_R u
    (zero when R is empty or its mean lies along c₁), float64."""
    c1 = eigh_gram(covariance(moments(reduced, prefix), center=True))[1][:, 0]
    s = reduced[prefix + "reference_sum"]
    r = s - (s @ c1) * c1
    norm = r.norm()
    return c1, r / torch.where(norm > 0, norm, 1.0)


def scores(rows: torch.Tensor, c1: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """score_i = cos(P u_i, r̂) of every row, float64 (0 for a row along c₁)."""
    out = []
    for block in rows.split(BLOCK_ROWS):
        x = block.to(torch.float64)
        x = x - (x @ c1)[:, None] * c1
        norm = x.norm(dim=1)
        out.append(torch.where(norm > 0, (x @ r) / norm.clamp_min(torch.finfo(torch.float64).tiny), 0.0))
    return torch.cat(out) if out else rows.new_zeros(0, dtype=torch.float64)


def score_stats(score: torch.Tensor, reference: torch.Tensor, threshold: float, prefix: str = "") -> dict[str, Stat]:
    """Round 1: over this rank's rows outside R, the number with score ≥ `threshold`
    (``suspected``), their count and score sum; the score sum inside R."""
    outside = ~reference  # masks, not selections: no host read
    return {
        prefix + "suspected": Stat(((score >= threshold) & outside).sum(dtype=torch.float64)),
        prefix + "outside_count": Stat(outside.sum(dtype=torch.float64)),
        prefix + "outside_score_sum": Stat(torch.where(outside, score, 0.0).sum()),
        prefix + "reference_score_sum": Stat(torch.where(reference, score, 0.0).sum()),
    }


def finish(reduced: Reduced, prefix: str = "") -> dict[str, float]:
    """``suspected`` (count), ``reference`` (|R|), ``mean_score`` (outside R) and
    ``reference_mean_score``; the scores are NaN when R is empty or holds every token."""
    n_ref = float(reduced[prefix + "reference_count"])
    n_out = float(reduced[prefix + "outside_count"])
    valid = n_ref > 0 and n_out > 0
    nan = float("nan")
    return {
        "suspected": float(reduced[prefix + "suspected"]) if valid else nan,
        "reference": n_ref,
        "mean_score": float(reduced[prefix + "outside_score_sum"]) / n_out if valid else nan,
        "reference_mean_score": float(reduced[prefix + "reference_score_sum"]) / n_ref if valid else nan,
    }


def under_trained_scores(rows: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """The score of each of this rank's `rows` against the reference mask `reference`, both
    rounds reduced with `reduce_stats` (collective under torch.distributed)."""
    reduced = reduce_stats(reference_stats(rows, reference))
    return scores(rows, *directions(reduced))


__all__ = ["directions", "finish", "reference_stats", "score_stats", "scores", "under_trained_scores"]
