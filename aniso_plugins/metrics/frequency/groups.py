"""Frequency groups of the vocabulary by training-target count (Yu et al. 2022, the AGG paper,
§3; docs/methods.md §1.8): the cumulative counts of training targets and the rare / medium /
frequent split. The metric plugins `frequency` and `eval` read one shared counter
(`aniso_plugins.metrics.frequency.target_counts`)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist

from aniso_plugins.core.targets import count_targets
from aniso_plugins.numerics.distributed import is_distributed

GROUPS = ("rare", "medium", "frequent")
"""Group names; `frequency_groups` returns their indices 0, 1, 2."""


UNSEEN = len(GROUPS)
"""The group index of ids outside every group (``seen_only``: count 0)."""


def frequency_groups(counts: torch.Tensor, fractions: tuple[float, float, float] = (0.2, 0.5, 0.3),
                     seen_only: bool = False) -> torch.Tensor:
    """Group index per token id (0 rare, 1 medium, 2 frequent) from target counts; with
    `seen_only`, the shares are of the ids with a nonzero count and the others get `UNSEEN`.

    Tokens are ordered by count, descending, ties broken by ascending id (a stable sort; with
    no counts yet the split is by id). The first ⌊f_frequent·V + ½⌋ of that order are frequent,
    the last ⌊f_rare·V + ½⌋ rare, the rest medium: `fractions` = (rare, medium, frequent)
    shares, default 20% / 50% / 30% of the vocabulary as in the AGG paper §3. (The official AGG
    evaluation code uses fixed id boundaries of its sorted dictionary instead, docs/methods.md §1.8.)"""
    if counts.dim() != 1:
        raise ValueError(f"counts must be 1-D (V,), got shape {tuple(counts.shape)}")
    if len(fractions) != 3 or any(not 0 < f < 1 for f in fractions) or abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(
            f"fractions={fractions!r}: expected three shares in (0, 1) summing to 1 (rare, medium, frequent)"
        )
    order = torch.sort(counts, descending=True, stable=True).indices
    groups = torch.ones(counts.numel(), dtype=torch.long, device=counts.device)
    if seen_only:
        groups[counts == 0] = UNSEEN
        order = order[: int((counts > 0).sum())]
    v = order.numel()
    n_rare, n_freq = math.floor(fractions[0] * v + 0.5), math.floor(fractions[2] * v + 0.5)
    groups[order[:n_freq]] = 2
    groups[order[v - n_rare :]] = 0
    return groups


class CumulativeTargetCounts:
    """Cumulative counts of training targets (ids in [0, V), `ignore_index` skipped).

    `add` counts a micro-batch's targets into a pending local vector on the counts' device; `sync` (collective:
    all ranks, once per optimizer step) sums the pending vectors across ranks and adds them to
    ``counts``, which is therefore identical on every rank."""

    def __init__(self, vocab_size: int, ignore_index: int = -100) -> None:
        self.vocab_size = vocab_size
        self.ignore_index = ignore_index
        self.counts = torch.zeros(vocab_size, dtype=torch.long)
        self._pending: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> None:
        """Keep the counts on `device` (the model's, where the collectives run: NCCL takes device
        tensors only); the adapter's device is known when training begins."""
        self.counts = self.counts.to(device)
        self._pending = None if self._pending is None else self._pending.to(device)

    def add(self, targets: torch.Tensor) -> None:
        """Count a micro-batch's targets (`count_targets`: on the counts' device, no host read)."""
        local = count_targets(targets, self.vocab_size, self.ignore_index, self.counts.device)
        self._pending = local if self._pending is None else self._pending + local

    def sync(self, group: dist.ProcessGroup | None = None) -> None:
        """Add the pending counts, summed over `group` (default: the world), to the totals."""
        pending = self._pending
        if pending is None:
            pending = torch.zeros(self.vocab_size, dtype=torch.long, device=self.counts.device)
        if is_distributed():
            dist.all_reduce(pending, group=group)
        self.counts = self.counts + pending
        self._pending = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"counts": self.counts.detach().cpu().clone()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        counts = state["counts"]
        if counts.shape != (self.vocab_size,):
            raise ValueError(f"saved counts have shape {tuple(counts.shape)}, expected ({self.vocab_size},)")
        self.counts = counts.to(dtype=torch.long, device=self.counts.device).clone()


__all__ = ["CumulativeTargetCounts", "GROUPS", "UNSEEN", "frequency_groups"]
