"""The AGG head: the gated forward installed in place on an LM head module (the one head
that AGG arms, in every adapter). The math lives in `aniso_plugins.methods.agg.gates` (gates, `agg_linear`)
and `aniso_plugins.methods.agg.fused_ce` (the fused chunked cross-entropy); this module only decides which
one a call runs."""

from __future__ import annotations

import logging

import torch
from torch import nn

from aniso_plugins.core.errors import SetupError
from aniso_plugins.core.steps import TargetChunks
from aniso_plugins.methods.agg.fused_ce import agg_cross_entropy
from aniso_plugins.methods.agg.gates import AGGGates, agg_linear
from aniso_plugins.methods.heads.lowrank import LowRankHead

logger = logging.getLogger("aniso_plugins")


class AGGForward:
    """The AGG-gated forward, installed in place on an LM head module: the one AGG head.

    The module object and its Parameters stay what they are (tying, state-dict keys, FSDP2
    groups and DDP hooks keep working); only ``module.forward`` becomes an instance attribute.
    `arm` hands over one training micro-batch's targets and gates; the next forward(s) that run
    in training mode with gradients enabled consume them, reading ``module.weight`` (and
    ``module.bias``) at call time, where FSDP2 has unsharded them (a head whose ``weight`` is a
    computed property, W = A·B, works too), and return either

    - the logits of `agg_linear` (plain values, gated weight gradient), one chunk of the
      targets per call when the adapter runs the head in ``chunks`` pieces (torchtitan's
      chunked loss), or
    - with a `loss_normalizer` (only where the adapter owns the loss), the fused chunked AGG
      cross-entropy of the whole micro-batch, ``Σ_{i: y_i ≠ ignore} CE_i / loss_normalizer``
      (`aniso_plugins.agg_cross_entropy`), never the full logits.

    Any other call runs the module's original forward. `remove` restores it.
    """

    def __init__(self, module: nn.Module, ignore_index: int = -100, chunk_size: int | None = None) -> None:
        check_linear_head(module, framework_forward=True)  # the caller checked the head
        self.module = module
        self.ignore_index = ignore_index
        self.chunk_size = chunk_size
        self._own_forward = "forward" in module.__dict__
        self._original = module.forward
        self._targets: TargetChunks | None = None
        self._gates: AGGGates | None = None
        self._normalizer: torch.Tensor | None = None
        self._warned = False
        module.forward = self.forward

    def arm(
        self,
        targets: torch.Tensor,
        gates: AGGGates,
        *,
        chunks: int = 1,
        loss_normalizer: torch.Tensor | None = None,
    ) -> None:
        """One micro-batch's targets (aligned with the head's output positions) and gates for
        the next forward, or for the next `chunks` forwards (equal chunks of the last target
        dimension, in order); with `loss_normalizer` the next forward returns the fused loss."""
        if loss_normalizer is not None and chunks != 1:
            raise ValueError("AGGForward.arm: the fused loss takes the whole micro-batch in one call (chunks=1)")
        self._targets = TargetChunks(targets, chunks)
        self._gates = gates
        self._normalizer = loss_normalizer

    def disarm(self) -> None:
        """Drop targets that no forward consumed."""
        self._targets = self._gates = self._normalizer = None

    @property
    def armed(self) -> bool:
        return self._targets is not None and not self._targets.exhausted

    def remove(self) -> None:
        """Restore the module's original forward."""
        if self._own_forward:
            self.module.forward = self._original
        else:
            del self.module.forward
        self.disarm()

    def forward(self, input: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # noqa: A002 - torchtitan reads `input`
        if self.module.training and torch.is_grad_enabled():
            if self.armed:
                if args or kwargs:
                    raise TypeError("AGG head: the gated forward takes only the hidden states")
                return self._gated(input)
            if not self._warned:
                self._warned = True
                logger.warning(
                    "AGG: the LM head ran in training without targets for this micro-batch; its weight "
                    "gradient is not gated (the adapter must announce each micro-batch before its forward)"
                )
        return self._original(input, *args, **kwargs)

    def _gated(self, hidden: torch.Tensor) -> torch.Tensor:
        targets, gates, normalizer = self._targets.take(), self._gates, self._normalizer
        weight, bias = self.module.weight, getattr(self.module, "bias", None)
        if self._targets.exhausted:
            self.disarm()
        if normalizer is None:
            return agg_linear(hidden, weight, targets, gates, bias, self.ignore_index)
        return agg_cross_entropy(
            hidden,
            weight,
            targets,
            gates,
            bias=bias,
            ignore_index=self.ignore_index,
            reduction="sum",
            normalizer=normalizer,
            chunk_size=self.chunk_size,
        )


LINEAR_FORWARDS = (nn.Linear.forward, LowRankHead.forward)
"""Forwards known to compute exactly ``F.linear(x, module.weight, module.bias)`` (up to rounding)."""


def check_linear_head(module: nn.Module, framework_forward: bool = False) -> None:
    """Raise `SetupError` unless `module`'s forward is exactly a linear map of its ``weight``
    (and ``bias``): the AGG head replaces that forward by ``agg_linear(x, weight, ...)``, so
    anything else it computes (a logit scale, a soft-cap, a norm) would silently be lost.
    `framework_forward`: the trainer sets an instance forward around the class forward that
    changes no value (`ModelHandle.framework_wraps_head_forward`)."""
    name = type(module).__qualname__
    installed = getattr(module.forward, "__self__", None)
    if isinstance(installed, AGGForward):
        raise SetupError(
            f"the LM head {name} already has an AGG forward installed, by a session that was not detached "
            "(e.g. a notebook cell run twice): call .detach() on the callback that installed it, or "
            "aniso_plugins.detach(model), then attach again"
        )
    if "forward" in module.__dict__ and not framework_forward:
        raise SetupError(
            f"the LM head {name} has a forward of its own set on the instance ({module.forward!r}); AGG would "
            "replace it. Remove that patch, or train without AGG"
        )
    if type(module).forward not in LINEAR_FORWARDS:
        raise SetupError(
            f"AGG needs an LM head whose forward is exactly F.linear(x, weight, bias); {name}.forward is code of "
            "its own (e.g. a logit scale or soft-cap), which the gated forward would bypass and silently change "
            "the logits. Use an nn.Linear head and apply the extra computation after it in the model's forward, "
            "or train without AGG"
        )


__all__ = ["AGGForward", "LINEAR_FORWARDS", "check_linear_head"]
