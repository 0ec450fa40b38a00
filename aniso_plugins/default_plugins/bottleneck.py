"""Gradient-bottleneck probe (Godey & Artzi 2026; `aniso_plugins.bottleneck`): lost fraction and
kept cosine of the LM head's logit gradients on one training micro-batch.

On the first micro-batch of every ``config.bottleneck_every``-th optimizer step (else every
``config.metrics_every``-th, else every step announced with ``measure=True``), hooks on the head
record, without changing any value or gradient:

- forward pre-hook: the head input h is replaced by a view of itself, so that a tensor hook on
  that view receives the head's own contribution dh_i = c·Wᵀg_i (even if h feeds other modules);
- forward hook: this rank's rows of the weight the head used give a local d×d Gram (summed
  across ranks at the measurement: the full WᵀW of the pre-step head, also under FSDP2);
- tensor hook on the logits: ‖c·g_i‖² per position (`squared_row_norms`; positions without a
  loss have g_i = 0 and are skipped);
- tensor hook on the input view: dh_i, kept (float32, or float64 if the gradient is) until the
  measurement.

Hooks on the module (not a replaced ``forward``) keep working when another plugin overrides the
head's ``forward`` (AGG), whose hidden-state gradient is the ordinary one. Cost: one Gram
(2Vd²/world flops) in the forward, a pass over the logits gradient, N·d floats of memory, and at
the measurement one d×d eigen-decomposition and N·d² flops. The probe needs logits of width V
as the head's output and a head input that requires grad; otherwise that micro-batch records
nothing. Metrics are reported at the next measurement as ``bottleneck/<metric>``
(`aniso_plugins.bottleneck.bottleneck_finish`), pooled over the ranks' probe positions.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..bottleneck import bottleneck_finish, bottleneck_stats, squared_row_norms
from ..config import AnisoConfig
from ..distributed import local_rows
from ..hookspecs import hookimpl
from ..linalg import gram_stats_blocked
from ..model import ModelHandle
from ..reduce import Stat
from ..steps import StepInfo

PREFIX = "bottleneck/"


class BottleneckPlugin:
    """Probe of the LM-head gradient bottleneck on one micro-batch per probe step."""

    name = "bottleneck"

    def __init__(self, config: AnisoConfig) -> None:
        self.every = config.bottleneck_every or config.metrics_every
        self.vocab_size = 0
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self._armed = False
        self._input: torch.Tensor | None = None
        self._gram: torch.Tensor | None = None
        self._grad_sq: torch.Tensor | None = None
        self._probe: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @hookimpl
    def aniso_setup(self, model: ModelHandle, config: AnisoConfig) -> None:
        head = model.head()
        self.vocab_size = model.vocab_size
        self.handles = [head.register_forward_pre_hook(self._pre_forward), head.register_forward_hook(self._forward)]
        for handle in self.handles:
            model.on_restore(handle.remove)

    def due(self, step: StepInfo) -> bool:
        """Whether `step` is a probe step (see the module docstring)."""
        return step.step % self.every == 0 if self.every else step.measure

    @hookimpl
    def aniso_targets(self, targets: torch.Tensor, step: StepInfo) -> None:
        self._armed = step.micro_batch == 0 and self.due(step)

    def _pre_forward(self, module: nn.Module, args: tuple):
        if not (self._armed and torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor)):
            return None
        if not args[0].requires_grad:
            return None
        self._input = args[0].view_as(args[0])
        return (self._input, *args[1:])

    def _forward(self, module: nn.Module, args: tuple, output) -> None:
        if self._input is None or not args or args[0] is not self._input:
            return
        hidden, self._input = self._input, None
        self._armed = False
        logits = isinstance(output, torch.Tensor) and output.dim() >= 1 and output.shape[-1] == self.vocab_size
        if not (logits and output.requires_grad):  # e.g. a head that returned the fused loss
            return
        self._gram = gram_stats_blocked(local_rows(module.weight.detach()).rows).gram
        output.register_hook(self._on_logits_grad)
        hidden.register_hook(self._on_input_grad)

    def _on_logits_grad(self, grad: torch.Tensor) -> None:
        self._grad_sq = squared_row_norms(grad.detach().reshape(-1, grad.shape[-1]))

    def _on_input_grad(self, grad: torch.Tensor) -> None:
        dh = grad.detach().reshape(-1, grad.shape[-1])
        dh = dh.to(torch.promote_types(dh.dtype, torch.float32), copy=True)
        if self._grad_sq is not None and self._gram is not None and self._grad_sq.shape[0] == dh.shape[0]:
            self._probe = (self._gram, dh, self._grad_sq)
        self._gram = self._grad_sq = None

    @hookimpl
    def aniso_metric_stats(
        self, step: StepInfo, kind: str, round_index: int, reduced: Mapping[str, torch.Tensor]
    ) -> dict[str, Stat] | None:
        if kind != "train" or self._probe is None:
            return None
        gram, dh, grad_sq = self._probe
        if round_index == 0:  # the head's WᵀW, summed over the ranks' rows
            return {PREFIX + "gram": Stat(gram)}
        if round_index == 1:  # the probe positions' kept and lost parts, from the full WᵀW
            return bottleneck_stats(dh, grad_sq, reduced[PREFIX + "gram"], PREFIX)
        return None

    @hookimpl
    def aniso_metrics(
        self, step: StepInfo, kind: str, reduced: Mapping[str, torch.Tensor]
    ) -> dict[str, float] | None:
        if kind != "train" or self._probe is None:
            return None
        self._probe = None
        return {PREFIX + name: value for name, value in bottleneck_finish(reduced, PREFIX).items()}


__all__ = ["BottleneckPlugin"]
