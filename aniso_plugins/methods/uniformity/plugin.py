"""Uniformity (Wang & Isola 2020; `aniso_plugins.methods.uniformity.kernels`) as a regularizer and as a metric,
docs/methods.md §13.

`UniformityPlugin` (``"uniformity"`` in ``AnisoConfig.method``) adds, by ``uniformity_on``:

- ``"head"``: the loss term ``uniformity_head = uniformity_weight · L_uniform(W)`` of the LM
  head rows (`row_uniformity`: exact blockwise, or ``uniformity_sample`` rows drawn with a
  generator seeded from (step, micro-batch), identical on every rank and on resume;
  ``reg_exclude_ids`` and zero rows left out), once per optimizer step through
  `aniso_loss_terms` (on every micro-batch with weight / accumulation steps when
  ``reg_every_microbatch``), like `aniso_plugins.methods.regularizers.plugin.RegularizerPlugin`;
- ``"hidden"``: the activation term ``uniformity_hidden``: on every training micro-batch,
  L_uniform of the head inputs at the positions with a target (pairs within the rank's
  micro-batch), returned as the share ``uniformity_weight · L / (world · accumulation_steps)``:
  the parameters receive the gradient of the mean over ranks and micro-batches of the per-rank,
  per-micro-batch values (pairs never cross ranks or micro-batches). A rank with fewer than two
  positions returns a zero share connected to the hidden states.

`UniformityMetricPlugin` (``"uniformity"`` in ``AnisoConfig.metrics``) logs at every train
measurement:

- ``uniformity/head``: L_uniform of ``uniformity_rows`` head rows drawn with a generator seeded
  from the step (all rows when V ≤ uniformity_rows; zero rows left out). Each rank fills the
  sampled rows it holds into a zero (k × d) float64 buffer (round 0, summed: the sampled rows,
  never V × d); in round 1 each rank log-sum-exps its chunk of the buffer's rows against all of
  them, combined exactly over ranks (op "lse").
- ``uniformity/hidden``: L_uniform of up to ``hidden_samples`` head inputs per rank, drawn with a
  rank-seeded generator among the positions with a target of the measurement micro-batch (the
  first of a step with ``measure=True``; captured, detached, by a forward pre-hook on the head):
  log(Σ exp(−t‖x̂_i − x̂_j‖²) / #pairs) over the within-rank pairs of all ranks, pooled exactly.

Both are NaN, with a warning (once per metric), when there are fewer than two vectors or the
value is not finite.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from aniso_plugins.core.config import AnisoConfig, ConfigError
from aniso_plugins.core.hookspecs import hookimpl
from aniso_plugins.core.model import ModelHandle, SetupError
from aniso_plugins.core.plugin_base import Plugin
from aniso_plugins.core.plugins import logger
from aniso_plugins.core.steps import StepInfo
from aniso_plugins.methods.uniformity.kernels import row_uniformity, uniformity_finish, uniformity_stats
from aniso_plugins.numerics.distributed import chunk_bounds, local_rows, rank_and_world
from aniso_plugins.numerics.host_copy import to_host
from aniso_plugins.numerics.reduce import Stat, batch_scope

HEAD_TERM = "uniformity_head"
HIDDEN_TERM = "uniformity_hidden"
HEAD_PREFIX = "uniformity/head/"
HIDDEN_PREFIX = "uniformity/hidden/"


class UniformityPlugin(Plugin):
    """The uniformity regularizer of the head rows and / or the micro-batches' hidden states."""

    name = "uniformity"
    acts_in_head_forward = True

    def __init__(self, config: AnisoConfig) -> None:
        if not config.uses("uniformity"):
            raise ConfigError(
                f"method={config.method!r}: UniformityPlugin runs only with 'uniformity' among the methods"
            )
        super().__init__(config)

    def setup(self, model: ModelHandle) -> None:
        config = self.config
        bad = [i for i in config.reg_exclude_ids if i >= model.vocab_size]
        if bad and "head" in config.uniformity_on:
            raise ConfigError(
                f"reg_exclude_ids={config.reg_exclude_ids!r}: ids {bad} are >= the vocabulary size {model.vocab_size}"
            )
        if "head" in config.uniformity_on:
            model.require_trainable_head("method='uniformity' on the head rows")

    def head_value(self, weight: torch.Tensor, step: StepInfo) -> torch.Tensor:
        """The unweighted L_uniform of the head rows for this call (sampled rows seeded from
        (step, micro-batch))."""
        cfg = self.config
        generator = None
        if cfg.uniformity_sample is not None:
            generator = step.generator()
        return row_uniformity(
            weight,
            cfg.uniformity_t,
            block=cfg.uniformity_block,
            sample=cfg.uniformity_sample,
            generator=generator,
            exclude_ids=cfg.reg_exclude_ids,
        )

    @hookimpl
    def aniso_loss_terms(self, step: StepInfo) -> dict[str, torch.Tensor] | None:
        if "head" not in self.config.uniformity_on:
            return None
        term = self.config.uniformity_weight * self.head_value(self.model.head_weight_in_forward(), step)
        if self.config.reg_every_microbatch:
            term = term / step.accumulation_steps
        return {HEAD_TERM: term}

    @hookimpl
    def aniso_activation_loss_terms(
        self, hidden: torch.Tensor, targets: torch.Tensor, step: StepInfo
    ) -> dict[str, torch.Tensor] | None:
        if "hidden" not in self.config.uniformity_on:
            return None
        if tuple(targets.shape) != tuple(hidden.shape[:-1]):
            raise SetupError(
                f"uniformity (hidden): the head input {tuple(hidden.shape)} and the targets {tuple(targets.shape)} are "
                "not aligned; the adapter must pass the targets of the head's output positions"
            )
        flat = hidden.reshape(-1, hidden.shape[-1])
        keep = (targets.reshape(-1) != self.config.ignore_index).to(flat.device, non_blocking=True)
        # positions without a target become zero rows, which take no part: a static shape, no boolean index
        rows = torch.where(keep.unsqueeze(1), flat, torch.zeros((), dtype=flat.dtype, device=flat.device))
        value = row_uniformity(rows, self.config.uniformity_t, block=self.config.uniformity_block)
        return {HIDDEN_TERM: value * (self.config.uniformity_weight / (step.batch_ranks * step.accumulation_steps))}


class UniformityMetricPlugin(Plugin):
    """L_uniform of sampled head rows and of the measurement micro-batch's head inputs."""

    name = "uniformity_metric"

    def __init__(self, config: AnisoConfig) -> None:
        super().__init__(config)
        self._armed = False
        self._targets: torch.Tensor | None = None
        self._head_calls = 1
        self._hidden: dict[str, Stat] | None = None
        self._generator: torch.Generator | None = None
        self._warned: set[str] = set()

    def setup(self, model: ModelHandle) -> None:
        handle = model.head().register_forward_pre_hook(self._capture)
        model.on_restore(handle.remove)
        self._generator = torch.Generator().manual_seed(rank_and_world()[0])

    @hookimpl
    def aniso_targets(self, targets: torch.Tensor, step: StepInfo) -> None:
        self._armed = step.measure and step.micro_batch == 0
        if self._armed:
            self._targets, self._head_calls, self._hidden = targets.detach(), step.head_calls, None

    @hookimpl
    def aniso_step_end(self, step: StepInfo) -> None:
        self._armed = False
        self._targets = None

    def _capture(self, module: nn.Module, args: tuple) -> None:
        if not (self._armed and module.training and args and isinstance(args[0], torch.Tensor)):
            return
        self._armed = False  # the first head call (the first chunk where the head runs on chunks)
        x = args[0].detach()
        flat = x.reshape(-1, x.shape[-1])
        t = self._targets
        for candidate in (t, t.chunk(self._head_calls, dim=-1)[0] if t is not None else None):
            if candidate is not None and tuple(candidate.shape) == tuple(x.shape[:-1]):
                flat = flat[(candidate.reshape(-1) != self.config.ignore_index).to(flat.device)]
                break
        cfg = self.config
        pick = torch.randperm(flat.shape[0], generator=self._generator)[: cfg.hidden_samples].to(flat.device)
        self._hidden = uniformity_stats(flat[pick], cfg.uniformity_t, HIDDEN_PREFIX, cfg.uniformity_block)

    def _head_rows(self, step: StepInfo) -> torch.Tensor:
        """This rank's share of the (k × d) float64 buffer of sampled head rows (zeros elsewhere)."""
        weight = local_rows(self.model.head_weight().detach())
        total, k = weight.total, min(self.config.uniformity_rows, weight.total)
        device = weight.rows.device
        if k == total:
            ids = torch.arange(total, device=device)
        else:
            ids = torch.randperm(total, generator=torch.Generator().manual_seed(step.step))[:k].to(device)
        own = ids - weight.offset
        mine = (own >= 0) & (own < weight.rows.shape[0])  # this rank's sampled rows; the others 0 (no host read)
        rows = weight.rows.index_select(0, own.clamp(0, max(weight.rows.shape[0] - 1, 0))).to(torch.float64)
        return torch.where(mine[:, None], rows, 0.0)

    def train_stats(self, step: StepInfo, round_index: int, reduced: Mapping[str, torch.Tensor]) -> dict[str, Stat] | None:
        if round_index > 1:
            return None
        cfg = self.config
        if round_index == 0:
            hidden = self._hidden
            if hidden is None:  # no measurement micro-batch seen on this rank: no pair
                empty = torch.zeros(0, self.model.hidden_size, device=self.model.device)
                hidden = uniformity_stats(empty, cfg.uniformity_t, HIDDEN_PREFIX)
            return {HEAD_PREFIX + "rows": Stat(self._head_rows(step))} | batch_scope(hidden)
        # round 1: every rank holds the sampled rows; each takes the pairs of its chunk of them
        rows = reduced[HEAD_PREFIX + "rows"]
        rank, world = rank_and_world()
        lo, hi = chunk_bounds(len(rows), rank, world)
        return uniformity_stats(rows, cfg.uniformity_t, HEAD_PREFIX, cfg.uniformity_block, slice(lo, hi))

    def train_metrics(self, step: StepInfo, reduced: Mapping[str, torch.Tensor]) -> dict[str, float] | None:
        if HEAD_PREFIX + "pairs" not in reduced:
            return None
        self._hidden = None
        reduced = to_host({k: v for k, v in reduced.items() if k.startswith((HEAD_PREFIX, HIDDEN_PREFIX))})  # one read
        out = {"uniformity/head": uniformity_finish(reduced, HEAD_PREFIX)}
        out["uniformity/hidden"] = uniformity_finish(reduced, HIDDEN_PREFIX)
        for name, value in out.items():
            if math.isnan(value) and name not in self._warned:
                self._warned.add(name)
                logger.warning(
                    "aniso_plugins uniformity: aniso/%s is NaN at step %d (fewer than two nonzero vectors%s, or a "
                    "non-finite value); training goes on (warned once)",
                    name,
                    step.step,
                    " on a measurement micro-batch" if name.endswith("hidden") else "",
                )
        return out


__all__ = ["UniformityMetricPlugin", "UniformityPlugin"]
