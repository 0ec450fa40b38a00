"""Spectra through the d×d Gram matrix: the one home of the Gram machinery that the geometry
metrics and spectrum control share (performance.md §5.1-5.3).

σ_i(W) = sqrt(λ_i(WᵀW)); for a row-sharded W, WᵀW = Σ_r W_rᵀW_r, so every rank computes the
Gram of its `local_rows` and one SUM reduction gives the full Gram. Centering uses
WᵀW − n·μμᵀ with μ the mean row, from the same reduced sums. Float64 throughout.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from .distributed import is_distributed


class GramStats(NamedTuple):
    """Σ_i w_i w_iᵀ (d, d), Σ_i w_i (d,), and the row count n (0-d), all float64."""

    gram: torch.Tensor
    row_sum: torch.Tensor
    count: torch.Tensor


def gram_stats(rows: torch.Tensor) -> GramStats:
    """Local sufficient statistics of the rows (differentiable; float64)."""
    x = rows.to(torch.float64)
    return GramStats(x.T @ x, x.sum(0), torch.tensor(float(x.shape[0]), dtype=torch.float64, device=x.device))


def covariance(stats: GramStats, center: bool) -> torch.Tensor:
    """WᵀW (center=False) or (W − 1μᵀ)ᵀ(W − 1μᵀ) = WᵀW − n μμᵀ (center=True)."""
    if not center:
        return stats.gram
    n = stats.count.clamp_min(1.0)
    mean = stats.row_sum / n
    return stats.gram - n * torch.outer(mean, mean)


def singular_values(gram: torch.Tensor) -> torch.Tensor:
    """Singular values of W from G = WᵀW, descending, float64 (negative round-off clamped).
    Differentiable when G is (eigvalsh has a gradient for distinct eigenvalues)."""
    eig = torch.linalg.eigvalsh(gram.to(torch.float64))
    return eig.clamp_min(0.0).sqrt().flip(0)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Differentiable SUM across ranks (identity without torch.distributed): the gradient of
    each rank's input is the sum of the gradients of all ranks' outputs. Use it for
    regularizers over row-sharded weights."""
    if not is_distributed():
        return tensor
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(tensor, op=dist.ReduceOp.SUM)


__all__ = ["GramStats", "gram_stats", "covariance", "singular_values", "all_reduce_sum"]
