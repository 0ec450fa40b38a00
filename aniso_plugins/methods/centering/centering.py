"""Output-embedding centering (Stollenwerk, Lokrantz & Hertzberg 2026, arXiv 2601.02031; official
code ``flxst/output-embedding-centering``), docs/methods.md §18, on the output embedding E (V × H)
with mean row μ = (1/V) Σ_i e_i:

- μ-centering: E ← E − 1μᵀ after every optimizer step (their ``train.py``), so that μ = 0;
- μ-loss: the loss term λ·‖μ‖² (their ``model.py``; λ = 1e-4 in their runs), whose gradient
  ∂/∂e_i = 2λμ/V moves every row by the same vector.

Rows wherever they live (`aniso_plugins.numerics.rows`): a full tensor or replica in full; a
row-sharded DTensor (FSDP2, HSDP, a tensor-parallel vocabulary shard) from each rank's rows, μ
summed over the shards (float32 accumulation, float64 for a float64 weight). No host read.
"""

from __future__ import annotations

import torch

from aniso_plugins.numerics.rows import global_sum, local_part, no_autocast, row_mean, split_rows, work_dtype


def center_rows_(weight: torch.Tensor) -> None:
    """μ-centering: subtract the mean row μ (over every shard, `row_mean`) from each row of the
    (V, H) `weight`, in place (its local shard for a DTensor)."""
    with torch.no_grad():
        rows = local_part(weight)
        rows.sub_(row_mean(weight).to(rows.dtype))


def mean_row_penalty(weight: torch.Tensor) -> torch.Tensor:
    """‖μ‖², μ = (1/V) Σ_i w_i, as a differentiable 0-d float64 tensor (μ-loss without its λ):
    a full tensor, or a ``Shard(0)`` DTensor reduced over its mesh (`split_rows`)."""
    parts = split_rows(weight, "mean_row_penalty")
    with no_autocast(parts.rows):
        total = global_sum(parts.rows.sum(0, dtype=work_dtype(parts.rows.dtype)), parts.group)
        mean = total.to(torch.float64) / parts.total
        return mean.dot(mean)


__all__ = ["center_rows_", "mean_row_penalty"]
