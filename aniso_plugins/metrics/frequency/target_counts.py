"""The counts of training targets that the frequency-group metrics share (rare / medium /
frequent split by count, AGG paper §3): one counter, one reduction per optimizer step, one
checkpoint entry, however many plugins read it."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from aniso_plugins.core.config import AnisoConfig
from aniso_plugins.core.hookspecs import hookimpl
from aniso_plugins.core.model import ModelHandle
from aniso_plugins.core.steps import RunInfo, StepInfo
from aniso_plugins.metrics.frequency.groups import CumulativeTargetCounts


class TargetCountsPlugin:
    """Counts every training micro-batch's targets (`CumulativeTargetCounts`), summed across ranks at
    each optimizer step. Registered by the built-in factory when the "frequency" or "eval"
    metrics are on, and handed to them. State: the counts, namespace "target_counts"."""

    name = "target_counts"

    def __init__(self) -> None:
        self.counter: CumulativeTargetCounts | None = None
        self._model: ModelHandle | None = None

    def ready(self) -> CumulativeTargetCounts:
        """The counter (after `aniso_setup`)."""
        if self.counter is None:
            raise RuntimeError("TargetCountsPlugin: aniso_setup(model, config) must run first")
        return self.counter

    @hookimpl
    def aniso_setup(self, model: ModelHandle, config: AnisoConfig) -> None:
        self.counter = CumulativeTargetCounts(model.vocab_size, config.ignore_index)
        self._model = model

    @hookimpl
    def aniso_begin_training(self, run: RunInfo) -> None:
        self.ready().to(self._model.device)  # where the model trains by now: the collectives' device

    @hookimpl
    def aniso_targets(self, targets: torch.Tensor, step: StepInfo) -> None:
        self.ready().add(targets)

    @hookimpl
    def aniso_step_end(self, step: StepInfo) -> None:
        self.ready().sync(step.batch_group)

    @hookimpl
    def aniso_state_dict(self) -> dict[str, dict[str, torch.Tensor]] | None:
        return None if self.counter is None else {self.name: self.counter.state_dict()}

    @hookimpl
    def aniso_load_state_dict(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        if self.name in state:
            self.ready().load_state_dict(state[self.name])


__all__ = ["TargetCountsPlugin"]
