"""Row-grouped gates of an LM head's weight gradient: what `gated_linear` and
`fused_linear_cross_entropy` multiply the logit gradient by before it reaches W (docs/methods.md §1.5).

    ∂L/∂W = (G ⊙ Γ)ᵀ X,   Γ_ik = g1_k + r_i·(g2_k − g1_k),   Γ_{i,y_i} = g_target[y_i],

r_i = 1 where row i's target is rare (0 on ignored rows). Γ is applied elementwise to each block of
G before its weight-gradient GEMM (`gate_block_`): no row is selected by a mask, so nothing reads a
value back to the host (docs/performance.md, "What the GPU pays").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["GATE_BLOCK_BYTES", "RowFlags", "RowGates", "columns_of", "gate_block_", "row_flags"]

GATE_BLOCK_BYTES = 4 * 2**20
"""Bytes of the float32 Γ temporary per row block of `gate_block_` (it stays in cache)."""


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


class RowFlags(NamedTuple):
    """How Γ acts on N rows: `rare` (N,) 1.0 where the row's target is rare (0 on ignored rows),
    `target_gate` (N,) the factor wanted at entry (i, y_i), g_target[y_i] or 1; both float."""

    rare: torch.Tensor
    target_gate: torch.Tensor


def row_flags(gates: RowGates, safe_targets: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> RowFlags:
    """`RowFlags` of flat global targets (`safe_targets`: ignored rows replaced by id 0, `valid`
    the non-ignored rows), elementwise: no data-dependent shape."""
    rare = (gates.rare[safe_targets] & valid).to(dtype)
    wanted = torch.ones_like(rare) if gates.g_target is None else gates.g_target.to(dtype)[safe_targets]
    return RowFlags(rare, wanted)


def columns_of(ids: torch.Tensor, kept: torch.Tensor, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's target column in a block of the ids [start, stop) (clamped into it, so that a
    gather or scatter stays in range) and whether the block holds it (`kept` rows only):
    elementwise, no data-dependent shape."""
    owned = kept & (ids >= start) & (ids < stop)
    return (ids - start).clamp(0, max(stop - start - 1, 0)), owned


def gate_block_(block: torch.Tensor, rare: torch.Tensor, g1: torch.Tensor, g2: torch.Tensor, local: torch.Tensor,
                owned: torch.Tensor, target_values: torch.Tensor, block_bytes: int = GATE_BLOCK_BYTES,
                row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``block ⊙ Γ`` in place, for a block of logit-gradient rows and columns: Γ_ik = g1_k +
    rare_i·(g2_k − g1_k) (`g1`, `g2`: the block's columns), times `row_scale`_i where given, then
    the target entry (i, local_i) of each row that owns its target set to `target_values` (the
    ungated entry times its wanted gate and row scale). Γ is formed `block_bytes` at a time
    (float32), so no block-sized temporary: rows at a time, or blocks of ids of an ids-major
    `block` (the transpose of a contiguous tensor: `Tile.transposed`)."""
    rows, cols = block.shape
    budget = min(block_bytes, GATE_BLOCK_BYTES)
    diff = g2 - g1
    if not block.is_contiguous() and block.T.is_contiguous():  # ids-major (`Tile.transposed`): blocks of ids
        step = min(cols, max(1, budget // (4 * max(rows, 1))))
        buffer = torch.empty(step * rows, dtype=g1.dtype, device=block.device)
        for k in range(0, cols, step):
            ids = slice(k, k + step)
            gamma = torch.addcmul(g1[ids, None], diff[ids, None], rare[None, :],
                                  out=buffer[: min(step, cols - k) * rows].view(-1, rows))
            if row_scale is not None:
                gamma.mul_(row_scale[None, :])
            block.T[ids].mul_(gamma)
    else:
        step = min(rows, max(1, budget // (4 * max(cols, 1))))
        buffer = torch.empty(step * cols, dtype=g1.dtype, device=block.device)
        for i in range(0, rows, step):
            part = rare[i : i + step, None]
            gamma = torch.addcmul(g1[None, :], part, diff[None, :], out=buffer[: part.shape[0] * cols].view(-1, cols))
            if row_scale is not None:
                gamma.mul_(row_scale[i : i + step, None])
            block[i : i + step].mul_(gamma)
    index = local[:, None]
    kept = block.gather(1, index).squeeze(1)
    block.scatter_(1, index, torch.where(owned, target_values.to(block.dtype), kept)[:, None])
    return block
