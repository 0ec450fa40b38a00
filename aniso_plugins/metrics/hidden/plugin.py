"""Hidden-state anisotropy per layer (Ethayarajh 2019's anisotropy baseline; A(H) of Godey et
al. 2024), docs/methods.md §7-§8.

Forward hooks on the transformer blocks (``ModelHandle.blocks()``) sample token
representations on the first micro-batch of each measurement step (the micro-batch whose
`StepInfo` has ``measure=True`` and ``micro_batch == 0``). Per layer and rank, k =
min(``config.hidden_samples``, positions) output positions are drawn uniformly without
replacement among the positions whose target is not ``config.ignore_index`` (all positions
when the block output's leading shape differs from the targets'); zero vectors are skipped.

**Estimator**: the mean of cos(h_i, h_j) over all ordered pairs i ≠ j of distinct sampled
positions, pooled over ranks, exactly, through (‖Σ u_i‖² − n)/(n(n − 1)) with u_i = h_i/‖h_i‖
(`aniso_plugins.metrics.geometry.stats.mean_cosine_finish`). It estimates Ethayarajh's baseline, the expected
cosine between random token occurrences; unlike his code (1000 pairs drawn with replacement,
where a vector can pair with itself) no position is paired with itself, and two positions may
hold the same token id. Memory: one d-vector and a count per layer; the sample is not kept.

Logged: ``hidden/layer_<i>/mean_cosine`` for block i (from 0); NaN when a layer saw fewer than
two samples in total (e.g. the adapter never announced a measurement micro-batch).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from aniso_plugins.core.config import AnisoConfig
from aniso_plugins.core.hookspecs import hookimpl
from aniso_plugins.core.model import ModelHandle
from aniso_plugins.core.plugin_base import Plugin
from aniso_plugins.core.steps import StepInfo
from aniso_plugins.metrics.geometry.stats import mean_cosine_stats, mean_cosine_value
from aniso_plugins.numerics.host_copy import read_values
from aniso_plugins.numerics.distributed import rank_and_world
from aniso_plugins.numerics.reduce import Stat


class HiddenStatesPlugin(Plugin):
    """Mean cosine between randomly sampled token representations after each block."""

    name = "hidden"
    reads_every_block = True

    def __init__(self, config: AnisoConfig) -> None:
        super().__init__(config)
        self.layers = 0
        self._active = False
        self._targets: torch.Tensor | None = None
        self._done: set[int] = set()
        self._stats: dict[int, dict[str, Stat]] = {}
        self._generator: torch.Generator | None = None

    def setup(self, model: ModelHandle) -> None:
        self.layers = model.hook_blocks(self._hook, "HiddenStatesPlugin ('hidden' in metrics)")
        self._generator = torch.Generator().manual_seed(rank_and_world()[0])

    @hookimpl
    def aniso_targets(self, targets: torch.Tensor, step: StepInfo) -> None:
        self._active = step.measure and step.micro_batch == 0
        if self._active:
            self._targets = targets.detach()
            self._done = set()
            self._stats = {}

    @hookimpl
    def aniso_step_end(self, step: StepInfo) -> None:
        self._active = False
        self._targets = None

    def _hook(self, index: int):
        def hook(module: torch.nn.Module, args, output) -> None:
            if not self._active or index in self._done:
                return
            x = output[0] if isinstance(output, tuple | list) else output
            if not isinstance(x, torch.Tensor):
                return
            self._done.add(index)
            x = x.detach()
            flat = x.reshape(-1, x.shape[-1])
            t = self.model.block_positions(self._targets)
            if t is not None and tuple(t.shape) == tuple(x.shape[:-1]):
                flat = flat[(t.reshape(-1) != self.config.ignore_index).to(flat.device)]
            pick = torch.randperm(flat.shape[0], generator=self._generator)[: self.config.hidden_samples]
            self._stats[index] = mean_cosine_stats(flat[pick.to(flat.device)], f"hidden/layer_{index}/")

        return hook

    def train_stats(self, step: StepInfo, round_index: int, reduced: Mapping[str, torch.Tensor]) -> dict[str, Stat] | None:
        if round_index > 0:
            return None
        stats: dict[str, Stat] = {}
        device = self.model.device
        for i in range(self.layers):
            stats |= self._stats.get(i) or mean_cosine_stats(
                torch.zeros(0, self.model.hidden_size, device=device), f"hidden/layer_{i}/"
            )
        return {name: stat._replace(over=self.model.block_stats_over) for name, stat in stats.items()}

    def train_metrics(self, step: StepInfo, reduced: Mapping[str, torch.Tensor]) -> dict[str, float] | None:
        layers = range(self.layers)
        out = read_values({f"hidden/layer_{i}/mean_cosine": mean_cosine_value(reduced, f"hidden/layer_{i}/") for i in layers})
        self._stats = {}
        return out


__all__ = ["HiddenStatesPlugin"]
