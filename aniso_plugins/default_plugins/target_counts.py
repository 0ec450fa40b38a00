"""The counts of training targets that the frequency-group metrics share (rare / medium /
frequent split by count, AGG paper §3): one counter, one reduction per optimizer step, one
checkpoint entry, however many plugins read it."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from ..config import AnisoConfig
from ..distributed import is_distributed
from ..hookspecs import hookimpl
from ..model import ModelHandle
from ..steps import StepInfo


class TargetCounter:
    """Cumulative counts of training targets (ids in [0, V), `ignore_index` skipped).

    `add` bincounts a micro-batch's targets into a pending local vector; `sync` (collective:
    all ranks, once per optimizer step) sums the pending vectors across ranks and adds them to
    ``counts``, which is therefore identical on every rank."""

    def __init__(self, vocab_size: int, ignore_index: int = -100) -> None:
        self.vocab_size = vocab_size
        self.ignore_index = ignore_index
        self.counts = torch.zeros(vocab_size, dtype=torch.long)
        self._pending: torch.Tensor | None = None

    def add(self, targets: torch.Tensor) -> None:
        y = targets.reshape(-1)
        y = y[y != self.ignore_index]
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= self.vocab_size):
            raise ValueError(
                f"targets must lie in [0, {self.vocab_size}) or equal ignore_index={self.ignore_index}, "
                f"got values in [{int(y.min())}, {int(y.max())}]"
            )
        local = torch.bincount(y, minlength=self.vocab_size)
        self._pending = local if self._pending is None else self._pending + local.to(self._pending.device)

    def sync(self) -> None:
        pending = self._pending
        if pending is None:
            pending = torch.zeros(self.vocab_size, dtype=torch.long, device=self.counts.device)
        if is_distributed():
            dist.all_reduce(pending)
        self.counts = self.counts.to(pending.device) + pending
        self._pending = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"counts": self.counts.detach().cpu().clone()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        counts = state["counts"]
        if counts.shape != (self.vocab_size,):
            raise ValueError(f"saved counts have shape {tuple(counts.shape)}, expected ({self.vocab_size},)")
        self.counts = counts.to(dtype=torch.long, device=self.counts.device).clone()


class TargetCountsPlugin:
    """Counts every training micro-batch's targets (`TargetCounter`), summed across ranks at
    each optimizer step. Registered by the built-in factory when the "frequency" or "eval"
    metrics are on, and handed to them. State: the counts, namespace "target_counts"."""

    name = "target_counts"

    def __init__(self) -> None:
        self.counter: TargetCounter | None = None

    def ready(self) -> TargetCounter:
        """The counter (after `aniso_setup`)."""
        if self.counter is None:
            raise RuntimeError("TargetCountsPlugin: aniso_setup(model, config) must run first")
        return self.counter

    @hookimpl
    def aniso_setup(self, model: ModelHandle, config: AnisoConfig) -> None:
        self.counter = TargetCounter(model.vocab_size, config.ignore_index)

    @hookimpl
    def aniso_targets(self, targets: torch.Tensor, step: StepInfo) -> None:
        self.ready().add(targets)

    @hookimpl
    def aniso_step_end(self, step: StepInfo) -> None:
        self.ready().sync()

    @hookimpl
    def aniso_state_dict(self) -> dict[str, dict[str, torch.Tensor]] | None:
        return None if self.counter is None else {self.name: self.counter.state_dict()}

    @hookimpl
    def aniso_load_state_dict(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        if self.name in state:
            self.ready().load_state_dict(state[self.name])


__all__ = ["TargetCounter", "TargetCountsPlugin"]
