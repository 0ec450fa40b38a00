"""Alignment and uniformity (Wang & Isola, ICML 2020, "Understanding Contrastive Representation
Learning through Alignment and Uniformity on the Hypersphere"), docs/methods.md §13.

On unit-normalised vectors x̂ = x / ‖x‖:

    L_uniform(X) = log  mean_{i≠j} exp(−t ‖x̂_i − x̂_j‖²)          (paper: t = 2)
    L_align(X, Y) = mean_i ‖x̂_i − ŷ_i‖^α                          (paper: α = 2)

for pairs (x_i, y_i) of views of the same input. ‖x̂_i − x̂_j‖² = 2 − 2 x̂_i·x̂_j. Lower is more
uniform (resp. better aligned); L_uniform ≥ −2t, reached only in the limit of infinitely many
points spread over the sphere. The paper's code takes the mean over pairs i < j (``torch.pdist``),
which equals the mean over ordered pairs i ≠ j used here.
"""

from __future__ import annotations

import math

import torch


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


__all__ = ["alignment", "uniformity"]
