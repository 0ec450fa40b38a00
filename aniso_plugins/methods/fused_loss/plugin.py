"""The fused-loss plugin: decides whether the LM head computes the training loss, and arms it.

Asked after set-up (`aniso_head_computes_loss`), it fuses when ``config.fused_loss`` is True,
or is None and a plugin gates the head's weight gradient (AGG installed the training head) or
the trainer's own loss is chunked (`ParallelLayout.chunked_loss`: TRL's fused LM head, answered
token by token, `ParallelLayout.token_outputs`; Liger's), and the adapter reproduces the trainer's loss exactly
(``owns_loss``; else ``why_not`` says why, logged once at info level, or raised for
``fused_loss=True``). Fusing, it installs the training
head if no plugin did, and on each training micro-batch (after the other plugins' `aniso_targets`,
so AGG's gates are armed first) makes the head's next forward return the micro-batch's loss
(`aniso_plugins.methods.fused_loss.head.TrainingHead.fuse`).
"""

from __future__ import annotations

import logging

import torch

from aniso_plugins.core.config import AnisoConfig, ConfigError
from aniso_plugins.core.hookspecs import hookimpl
from aniso_plugins.core.layout import ParallelLayout
from aniso_plugins.core.model import ModelHandle
from aniso_plugins.core.plugin_base import Plugin
from aniso_plugins.core.steps import RunInfo, StepInfo
from aniso_plugins.methods.fused_loss.head import TrainingHead, check_linear_head

logger = logging.getLogger("aniso_plugins")


class FusedLossPlugin(Plugin):
    """Reads ``fused_loss``, ``fused_chunk_size`` and ``ignore_index``; built for every run."""

    name = "fused_loss"

    def __init__(self, config: AnisoConfig) -> None:
        super().__init__(config)
        self.head: TrainingHead | None = None
        self._smoothing = 0.0
        self._tokens: tuple[str, ...] | None = None

    def refuse_layout(self, layout: ParallelLayout) -> str | None:
        if layout.head_bypassed and self.config.fused_loss:
            return f"fused_loss=True acts in the LM head's forward, which {layout.head_bypassed}"
        return None

    @hookimpl
    def aniso_head_computes_loss(self, owns_loss: bool, why_not: str) -> bool:
        wanted = self.config.fused_loss
        model: ModelHandle = self.model
        installed = TrainingHead.installed_on(model.head())
        self._tokens = model.layout.token_outputs
        chunked = model.layout.chunked_loss is not None  # the trainer's own loss is chunked: keep it so
        if wanted is False or (wanted is None and not chunked and not (installed is not None and installed.gated)):
            return False
        if not owns_loss:
            if wanted:
                raise ConfigError(f"fused_loss=True: {why_not}; set fused_loss=None (automatic) or False")
            logger.info("aniso_plugins: AGG runs as the gated LM head, not the fused loss: %s", why_not)
            return False
        if installed is None:
            check_linear_head(model.head(), framework_forward=model.framework_wraps_head_forward, who="fused_loss")
            installed = TrainingHead(model.head(), ignore_index=self.config.ignore_index, shard=model.vocab_shard(),
                                     backward_twice=model.backward_runs_twice)
            model.on_restore(installed.remove)
        installed.chunk_size = self.config.fused_chunk_size
        transform = model.logit_transform  # the model's soft-cap or scale, applied in the fused loss
        installed.logit_transform = None if transform is None or transform.identity else transform
        self.head = installed
        return True

    @hookimpl
    def aniso_begin_training(self, run: RunInfo) -> None:
        self._smoothing = run.label_smoothing

    @hookimpl(trylast=True)
    def aniso_targets(self, targets: torch.Tensor, step: StepInfo) -> None:
        if self.head is None:
            return
        if not self.head.armed:  # no plugin gates the head: the plain fused loss
            self.head.arm(targets)
        self.head.fuse(step.loss_normalizer, self._smoothing, self._tokens)


__all__ = ["FusedLossPlugin"]
