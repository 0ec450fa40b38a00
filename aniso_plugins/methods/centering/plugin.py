"""``method="mu_centering"`` and ``method="mu_loss"``: output-embedding centering
(`aniso_plugins.methods.centering.centering`) after each optimizer step, or as a loss term."""

from __future__ import annotations

import torch

from aniso_plugins.core.hookspecs import hookimpl
from aniso_plugins.core.model import ModelHandle
from aniso_plugins.core.plugin_base import Plugin
from aniso_plugins.core.steps import StepInfo
from aniso_plugins.methods.centering.centering import center_rows_, mean_row_penalty


class MuCenteringPlugin(Plugin):
    """Subtracts the mean row from the head's weight after every optimizer step
    (`aniso_step_end`: the adapters call it once the step is applied). Stateless: a resumed run
    continues from centred weights."""

    name = "mu_centering"
    updates_head_rows = True

    def setup(self, model: ModelHandle) -> None:
        self.require_head_parameter(model)

    @hookimpl
    def aniso_step_end(self, step: StepInfo) -> None:
        center_rows_(self.model.head().weight)


class MuLossPlugin(Plugin):
    """Adds ``mu_loss_weight · ‖μ‖²`` once per optimizer step (logged as ``aniso/loss/mu_loss``),
    with the same accumulation conventions as the head regularizers (``reg_every_microbatch``)."""

    name = "mu_loss"
    acts_in_head_forward = True

    def setup(self, model: ModelHandle) -> None:
        model.require_trainable_head("method='mu_loss'")

    @hookimpl
    def aniso_loss_terms(self, step: StepInfo) -> dict[str, torch.Tensor]:
        term = self.config.mu_loss_weight * mean_row_penalty(self.model.head_weight_in_forward())
        if self.config.reg_every_microbatch:
            term = term / step.accumulation_steps
        return {self.name: term}


__all__ = ["MuCenteringPlugin", "MuLossPlugin"]
