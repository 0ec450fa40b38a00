"""Row-grouped gates of an LM head's weight gradient: what `gated_linear` and
`fused_linear_cross_entropy` multiply the logit gradient by before it reaches W (docs/methods.md §1.5).

    ∂L/∂W = (G ⊙ Γ)ᵀ X,   Γ_ik = g1_k if y_i ∉ V_r,  g2_k if y_i ∈ V_r,   Γ_{i,y_i} = g_target[y_i],

computed as a base-scaled GEMM plus corrections over the smaller row group (`RowGating`), never
forming G ⊙ Γ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from aniso_plugins.numerics.distributed import VocabShard

__all__ = ["RowGates", "RowGating", "row_gating"]


@dataclass(frozen=True)
class RowGates:
    """Per-vocabulary-id factors on the weight gradient of one micro-batch, by row group
    (detached constants, float32, shape (V,)): the logit-gradient entry (i, k) is multiplied by
    Γ_ik = g1_k if y_i ∉ rare, g2_k if y_i ∈ rare, and Γ_{i,y_i} = g_target[y_i].

    g1: factor on id k's logit gradient in rows whose target is not in `rare`;
    g2: the same in rows whose target is in `rare`;
    rare: bool (V,), the ids whose rows use g2;
    g_target: factor on the target entry (i, y_i); None means 1.

    AGG's gates are one instance (`aniso_plugins.methods.agg.gates.agg_gates`, docs/methods.md §1):
    g1 / g2 gate parts (b) / (c) of a rare id's gradient and g_target part (a).
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
                raise ValueError(f"RowGates.{name}: expected shape {tuple(v)} like g1, got {tuple(t.shape)}")
        if self.rare.dtype != torch.bool:
            raise TypeError(f"RowGates.rare: expected a bool tensor, got {self.rare.dtype}")

    @property
    def vocab_size(self) -> int:
        return self.g1.shape[0]

    def to(self, device: torch.device | str) -> RowGates:
        """The same gates on `device` (self when already there)."""
        if self.g1.device == torch.device(device):
            return self
        target = None if self.g_target is None else self.g_target.to(device)
        return RowGates(self.g1.to(device), self.g2.to(device), self.rare.to(device), target)


class RowGating(NamedTuple):
    """How Γ acts on N rows, for a weight gradient computed as base-scaled GEMM + corrections.

    base / other: gate vectors of the larger / smaller row group over the weight's rows (g1
    for non-rare-target rows, which include ignored rows, g2 for rare-target rows; the ids
    ``[start, stop)`` of a vocabulary shard); in_other: (N,) bool, rows of the smaller group
    (decided by the global targets, the same on every shard); target_fix: (N,) factor to add at
    entry (i, y_i) so that its gate becomes g_target[y_i] (1 by default) instead of the row's
    group gate (0 on ignored rows and where y_i is not in this shard); target_index: (N,) the
    weight row of y_i (y_i − start; 0 where target_fix is 0)."""

    base: torch.Tensor
    other: torch.Tensor
    in_other: torch.Tensor
    target_fix: torch.Tensor
    target_index: torch.Tensor


def row_gating(gates: RowGates, targets: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype,
               shard: VocabShard | None = None) -> RowGating:
    """`RowGating` for flat global `targets` (N,) with `valid` = targets != ignore_index, for
    the weight rows of `shard` (None: all V)."""
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
    if shard is None:
        return RowGating(base, other, in_other, fix, safe)
    owned = shard.owned(safe)
    index = torch.where(owned, safe - shard.start, 0)
    fix = torch.where(owned, fix, 0.0)
    return RowGating(base[shard.start : shard.stop], other[shard.start : shard.stop], in_other, fix, index)
