"""CosReg, the pairwise cosine hinge and spectrum control as one loss-term plugin.

``"cosreg"``, ``"hinge"`` or ``"spectrum"`` in ``AnisoConfig.method`` (at most one of them) builds
one `RegularizerPlugin`, named after the method; its loss term ``reg_weight · R(W)`` is logged as ``aniso/loss/<method>`` and
the unweighted R(W) as ``aniso/<method>/value``. W is read as ``model.head().weight`` at every
call: the tied or untied head's Parameter, a gated wrapper's, or a low-rank head's A·B.

Gradient accumulation: by default the hook runs once per optimizer step (on the last
micro-batch) and the term carries its full weight, so each optimizer step gets exactly one
``reg_weight · ∇R``. With ``config.reg_every_microbatch`` it runs on every micro-batch with
weight ``reg_weight / accumulation_steps``; the accumulated gradient is the same (for the
sampled hinge: the mean of A independent estimates).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from aniso_plugins.core.config import AnisoConfig, ConfigError
from aniso_plugins.core.hookspecs import hookimpl
from aniso_plugins.core.model import ModelHandle, SetupError
from aniso_plugins.core.plugin_base import Plugin
from aniso_plugins.core.steps import StepInfo
from aniso_plugins.methods.regularizers.penalties import cosine_hinge, cosreg, spectrum_penalty, weight_singular_values

REGULARIZERS = ("cosreg", "hinge", "spectrum")


class RegularizerPlugin(Plugin):
    """Adds ``config.reg_weight · R(W)`` for R = `cosreg` (reg_exclude_ids), `cosine_hinge`
    (hinge_margin, hinge_block, hinge_sample, reg_exclude_ids) or `spectrum_penalty`
    (spectrum_prior, spectrum_c1, spectrum_c2, spectrum_gamma).

    Sampled hinge: the rows of a call are drawn with a generator seeded from
    (step, micro-batch), identical on every rank and on a resumed run.
    Spectrum with ``spectrum_c1=None``: c1 = σ1 of the head at the first call (before the first
    optimizer step), kept in the plugin state so that a resumed run keeps the same prior.

    No host read in a training step after the first (docs/performance.md §5.8):
    the value of R is kept as a detached tensor and read at the measurement; the one read is
    spectrum's c1 (``float(σ1)``) at the first call of a run without ``spectrum_c1``."""

    acts_in_head_forward = True

    def __init__(self, config: AnisoConfig) -> None:
        chosen = [m for m in config.method if m in REGULARIZERS]
        if len(chosen) != 1:
            raise ConfigError(f"method={config.method!r}: RegularizerPlugin runs exactly one of {', '.join(REGULARIZERS)}")
        super().__init__(config)
        self.name = self.method = chosen[0]
        self.c1: float | None = config.spectrum_c1
        self.last_value: torch.Tensor | None = None  # detached, read at the next measurement only

    def setup(self, model: ModelHandle) -> None:
        config = self.config
        if self.method == "spectrum" and config.head == "lowrank":
            raise SetupError(
                "method='spectrum' with head='lowrank': a rank-r head has σ_k = 0 for k > r, where the "
                "spectrum penalty has no finite gradient; use head='untie' or 'keep'"
            )
        bad = [i for i in config.reg_exclude_ids if i >= model.vocab_size]
        if bad:
            raise ConfigError(
                f"reg_exclude_ids={config.reg_exclude_ids!r}: ids {bad} are >= the vocabulary size {model.vocab_size}"
            )
        model.require_trainable_head(f"method={self.method!r}")

    def penalty(self, weight: torch.Tensor, step: StepInfo) -> torch.Tensor:
        """The unweighted R(W) of the configured method for this call."""
        cfg = self.config
        if self.method == "cosreg":
            return cosreg(weight, cfg.reg_exclude_ids)
        if self.method == "hinge":
            generator = None
            if cfg.hinge_sample is not None:
                generator = step.generator()
            return cosine_hinge(
                weight,
                cfg.hinge_margin,
                block=cfg.hinge_block,
                sample=cfg.hinge_sample,
                generator=generator,
                exclude_ids=cfg.reg_exclude_ids,
            )
        if self.c1 is None and cfg.spectrum_prior != "ratio":
            self.c1 = float(weight_singular_values(weight.detach())[0])
        return spectrum_penalty(weight, cfg.spectrum_prior, c1=self.c1, c2=cfg.spectrum_c2, gamma=cfg.spectrum_gamma)

    @hookimpl
    def aniso_loss_terms(self, step: StepInfo) -> dict[str, torch.Tensor]:
        value = self.penalty(self.model.head_weight_in_forward(), step)
        self.last_value = value.detach()
        term = self.config.reg_weight * value
        if self.config.reg_every_microbatch:
            term = term / step.accumulation_steps
        return {self.name: term}

    def train_metrics(self, step: StepInfo, reduced: Mapping[str, torch.Tensor]) -> dict[str, float] | None:
        if self.last_value is None:
            return None
        return {f"{self.name}/value": float(self.last_value)}

    @hookimpl
    def aniso_state_dict(self) -> dict[str, dict[str, torch.Tensor]] | None:
        if self.method != "spectrum" or self.config.spectrum_c1 is not None or self.c1 is None:
            return None
        return {self.name: {"c1": torch.tensor(self.c1, dtype=torch.float64)}}

    @hookimpl
    def aniso_load_state_dict(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        if self.method == "spectrum" and self.config.spectrum_c1 is None and self.name in state:
            self.c1 = float(state[self.name]["c1"])


__all__ = ["RegularizerPlugin", "REGULARIZERS"]
