"""`UnderTrainedPlugin`, metric ``under_trained``: over training, how many tokens' head rows look
like those of unused tokens (`aniso_plugins.metrics.under_trained.indicator`).

The reference tokens are ``under_trained_reference_ids`` or, by default, the ids the run has
not yet seen as a training target (the shared target counts). Logged (train measurements):
``under_trained/suspected`` (tokens outside the reference with score ≥ the threshold),
``under_trained/reference`` (its size), ``under_trained/mean_score`` and
``under_trained/reference_mean_score``."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from aniso_plugins.core.config import AnisoConfig
from aniso_plugins.core.model import ModelHandle, SetupError
from aniso_plugins.core.plugin_base import Plugin
from aniso_plugins.core.plugins import logger
from aniso_plugins.core.steps import StepInfo
from aniso_plugins.metrics.frequency.target_counts import TargetCountsPlugin
from aniso_plugins.metrics.under_trained import indicator
from aniso_plugins.numerics.distributed import local_rows
from aniso_plugins.numerics.host_copy import to_host
from aniso_plugins.numerics.reduce import Stat

PREFIX = "under_trained/"


class UnderTrainedPlugin(Plugin):
    name = "under_trained"

    def __init__(self, config: AnisoConfig, counts: TargetCountsPlugin) -> None:
        super().__init__(config)
        self.counts = counts
        self._reference: torch.Tensor | None = None
        self._warned = False

    def setup(self, model: ModelHandle) -> None:
        ids = self.config.under_trained_reference_ids
        if ids and max(ids) >= model.vocab_size:
            raise SetupError(
                f"under_trained_reference_ids={list(ids)!r}: ids must be < the vocabulary size {model.vocab_size}"
            )

    def reference(self) -> torch.Tensor:
        """The (V,) bool mask of the reference tokens."""
        counts = self.counts.ready().counts
        if not self.config.under_trained_reference_ids:
            return counts == 0
        mask = torch.zeros(counts.shape[0], dtype=torch.bool)
        mask[list(self.config.under_trained_reference_ids)] = True
        return mask

    def train_stats(self, step: StepInfo, round_index: int, reduced: Mapping[str, torch.Tensor]) -> dict[str, Stat] | None:
        if round_index > 1:
            return None
        lr = local_rows(self.model.head_weight().detach())
        if round_index == 0:
            self._reference = self.reference()
        mine = self._reference[lr.offset : lr.offset + lr.rows.shape[0]].to(lr.rows.device)
        if round_index == 0:
            return indicator.reference_stats(lr.rows, mine, PREFIX)
        score = indicator.scores(lr.rows, *indicator.directions(reduced, PREFIX))
        return indicator.score_stats(score, mine, self.config.under_trained_threshold, PREFIX)

    def train_metrics(self, step: StepInfo, reduced: Mapping[str, torch.Tensor]) -> dict[str, float] | None:
        self._reference = None
        finishing = ("reference_count", "outside_count", "suspected", "outside_score_sum", "reference_score_sum")
        host = to_host({PREFIX + k: reduced[PREFIX + k] for k in finishing})  # the measurement's one read
        out = {PREFIX + k: v for k, v in indicator.finish(host, PREFIX).items()}
        if out[PREFIX + "mean_score"] != out[PREFIX + "mean_score"] and not self._warned:  # NaN
            self._warned = True
            logger.warning(
                "aniso_plugins under_trained: %d reference tokens at step %d (none, or every token): the scores are "
                "NaN until some tokens are and some are not (set under_trained_reference_ids to name unused ids)",
                int(out[PREFIX + "reference"]), step.step,
            )
        return out


__all__ = ["UnderTrainedPlugin"]
