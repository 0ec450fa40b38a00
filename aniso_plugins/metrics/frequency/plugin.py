"""Frequency groups: the geometry of the LM head within and between the rare / medium /
frequent groups (Yu et al. 2022, the AGG paper, §3). The split is `aniso_plugins.metrics.frequency.groups`'s;
the counts come from the shared `TargetCountsPlugin`, which `EvalPlugin` also reads for its
per-group perplexity and Uniq.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from aniso_plugins.core.config import AnisoConfig
from aniso_plugins.core.plugin_base import Plugin
from aniso_plugins.core.steps import StepInfo
from aniso_plugins.metrics.frequency.groups import GROUPS, frequency_groups
from aniso_plugins.metrics.frequency.target_counts import TargetCountsPlugin
from aniso_plugins.metrics.geometry.stats import (
    Spectrum,
    cross_cosine_value,
    isotropy_stats,
    isotropy_value,
    mean_cosine_stats,
    mean_cosine_value,
    moment_stats,
    moments,
)
from aniso_plugins.numerics.distributed import local_rows
from aniso_plugins.numerics.host_copy import read_values
from aniso_plugins.numerics.reduce import Stat


class FrequencyGroupsPlugin(Plugin):
    """Per frequency group of the LM head's rows: I(W) (raw, `aniso_plugins.metrics.geometry.rounds.isotropy`)
    and the mean pairwise cosine; and the mean cosine between the rare and the frequent rows
    (AGG paper §3: "the average cosine similarity between the rare and frequent group
    embeddings"). Groups come from the shared counter of training targets, `counts`.

    Logged (train measurements): ``frequency/<group>/isotropy``, ``frequency/<group>/mean_cosine``
    for group in rare, medium, frequent, and ``frequency/rare_frequent_cosine``."""

    name = "frequency"
    summary = {"I(W) rare": "frequency/rare/isotropy"}

    def __init__(self, config: AnisoConfig, counts: TargetCountsPlugin) -> None:
        super().__init__(config)
        self.counts = counts
        self._groups: torch.Tensor | None = None
        self._sizes: tuple[list[int], list[int]] | None = None  # (this rank's, all) rows per group

    def train_stats(self, step: StepInfo, round_index: int, reduced: Mapping[str, torch.Tensor]) -> dict[str, Stat] | None:
        if round_index > 1:
            return None
        counter = self.counts.ready()
        lr = local_rows(self.model.head_weight().detach())
        if round_index == 0:
            self._groups = frequency_groups(counter.counts, self.config.group_fractions, self.config.group_tokens == "seen")
        mine = self._groups[lr.offset : lr.offset + lr.rows.shape[0]].to(lr.rows.device)
        order = torch.argsort(mine, stable=True)  # this rank's rows, group by group
        if round_index == 0:  # the groups' sizes, here and over all ids: the measurement's one read of them
            index = torch.arange(len(GROUPS), device=mine.device)[:, None]
            sizes = torch.stack([(mine[None, :] == index).sum(1), (self._groups.to(mine.device)[None, :] == index).sum(1)])
            local, total = sizes.tolist()
            self._sizes = (local, total)
        local, total = self._sizes
        stats: dict[str, Stat] = {}
        start = 0
        for index, group in enumerate(GROUPS):
            prefix = f"frequency/{group}/"
            rows = lr.rows.index_select(0, order[start : start + local[index]])
            start += local[index]
            if round_index == 0:  # per group: Gram, row sum, count, unit-row sum
                stats |= moment_stats(rows, prefix) | mean_cosine_stats(rows, prefix)
            else:  # round 1: the partition functions of I(W) from the group's eigenvectors
                spec = Spectrum.from_moments(moments(reduced, prefix), False, total[index])
                stats |= isotropy_stats(rows, spec.eigenvectors, prefix)
        return stats

    def train_metrics(self, step: StepInfo, reduced: Mapping[str, torch.Tensor]) -> dict[str, float] | None:
        out: dict[str, torch.Tensor] = {}
        for group in GROUPS:
            prefix = f"frequency/{group}/"
            out[prefix + "isotropy"] = isotropy_value(reduced, prefix)
            out[prefix + "mean_cosine"] = mean_cosine_value(reduced, prefix)
        out["frequency/rare_frequent_cosine"] = cross_cosine_value(reduced, "frequency/rare/", "frequency/frequent/")
        self._groups = self._sizes = None
        return read_values(out)


__all__ = ["FrequencyGroupsPlugin"]
