"""Contextuality per layer (Ethayarajh 2019): self-similarity, intra-sentence similarity and the
anisotropy baseline, raw and adjusted; the math is `aniso_plugins.metrics.ethayarajh.stats`, docs/methods.md §7.1.

On the first micro-batch of each measurement step (``step.measure`` and ``micro_batch == 0``,
as the "hidden" metric):

1. `aniso_targets` (before the forward; collective-safe): the positions that count and their
   token ids (`token_positions`: ``step.input_ids`` / ``step.attention_mask`` when the adapter
   has them, else the causal shift of the targets), their counts summed over the ranks with
   `reduce_stats` (one V-vector), and from them the words measured, identical on every rank
   (`choose_words`, at most ``config.ethayarajh_words``);
2. forward hooks on the transformer blocks (``ModelHandle.blocks()``): each block's output on
   that micro-batch is folded into (k + 2) × d float64 sums (`layer_stats`); nothing of the
   activations is kept;
3. the measurement reduces those sums (round 0) and finishes them (`layer_finish`).

Logged, for block i (from 0): ``ethayarajh/layer_<i>/self_sim``, ``self_sim_adjusted``,
``intra_sim``, ``intra_sim_adjusted``, ``baseline``; and once: ``ethayarajh/words`` (words in
the SelfSim mean, before zero vectors), ``ethayarajh/repeated_words`` (ids seen at least twice;
more than ``words`` when the cap binds) and ``ethayarajh/baseline_pair_share`` (share of the
different-word pairs the baseline keeps, 1 unless the cap binds). NaN where undefined, and for a
layer whose output has non-finite entries (one warning).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from aniso_plugins.core.config import AnisoConfig
from aniso_plugins.core.hookspecs import hookimpl
from aniso_plugins.core.layout import ParallelLayout
from aniso_plugins.core.model import ModelHandle
from aniso_plugins.core.plugin_base import Plugin
from aniso_plugins.core.plugins import logger
from aniso_plugins.core.steps import StepInfo
from aniso_plugins.metrics.ethayarajh.stats import (
    WordSet,
    baseline_pair_share,
    choose_words,
    empty_layer_stats,
    finish_layer_parts,
    layer_parts,
    layer_stats,
    token_positions,
    word_counts,
)
from aniso_plugins.numerics.host_copy import to_host
from aniso_plugins.numerics.reduce import Stat, batch_scope, reduce_stats

PREFIX = "ethayarajh/"


class EthayarajhPlugin(Plugin):
    """Self-similarity and intra-sentence similarity of each block's output, per layer."""

    name = "ethayarajh"
    reads_every_block = True

    def __init__(self, config: AnisoConfig) -> None:
        super().__init__(config)
        self.layers = 0
        self._active = False
        self._positions: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None  # ids, counted, sentences
        self._words: WordSet | None = None
        self._pair_share = float("nan")
        self._stats: dict[int, dict[str, Stat]] = {}
        self._warned: set[str] = set()

    def refuse_layout(self, layout: ParallelLayout) -> str | None:
        mesh = layout.sequence_mesh
        if mesh is None:
            return None
        return (
            "metrics=('ethayarajh', ...) under sequence parallelism: IntraSim compares each token with its whole "
            f"sentence, which the {mesh.size()} ranks of {mesh.mesh_dim_names} hold in pieces; turn sequence "
            "parallelism off (torchtitan: --parallelism.no-enable-sequence-parallel) or measure it without tensor "
            "parallelism"
        )

    def setup(self, model: ModelHandle) -> None:
        self.layers = model.hook_blocks(self._hook, "EthayarajhPlugin ('ethayarajh' in metrics)")

    @hookimpl
    def aniso_targets(self, targets: torch.Tensor, step: StepInfo) -> None:
        self._active = step.measure and step.micro_batch == 0
        if not self._active:
            return
        input_ids = step.input_ids
        if input_ids is not None and tuple(input_ids.shape) != tuple(targets.shape):
            self._warn_once(
                "input_ids",
                "aniso_plugins ethayarajh: input_ids of shape %s do not match the targets' %s; token identity "
                "falls back to the causal shift of the targets",
                tuple(input_ids.shape),
                tuple(targets.shape),
            )
            input_ids = None
        ids, counted = token_positions(
            targets.detach(), input_ids, step.attention_mask, self.config.ignore_index, self.model.vocab_size,
            step.sequence_ids,
        )
        # collective-safe hook: every rank chooses the words from the same global counts
        counts = reduce_stats({PREFIX + "counts": Stat(word_counts(ids, self.model.vocab_size))}, group=step.batch_group)
        counts = counts[PREFIX + "counts"]
        self._positions = (ids, counted, step.sequence_ids)
        self._words = choose_words(counts, self.config.ethayarajh_words)
        self._pair_share = baseline_pair_share(counts, self._words)
        self._stats = {}

    @hookimpl
    def aniso_step_end(self, step: StepInfo) -> None:
        self._active = False
        self._positions = None

    def _hook(self, index: int):
        def hook(module: torch.nn.Module, args, output) -> None:
            if not self._active or index in self._stats or self._positions is None:
                return
            x = output[0] if isinstance(output, tuple | list) else output
            if not isinstance(x, torch.Tensor):
                return
            ids, counted, sentences = self._positions
            if tuple(x.shape[:-1]) != tuple(ids.shape):
                self._warn_once(
                    "shape",
                    "aniso_plugins ethayarajh: block %d's output %s is not (..., T, d) over the targets %s "
                    "(sequence-sharded or packed?); that layer is not measured",
                    index,
                    tuple(x.shape),
                    tuple(ids.shape),
                )
                return
            self._stats[index] = layer_stats(x, ids, counted, self._words, f"{PREFIX}layer_{index}/", sentences)

        return hook

    def train_stats(self, step: StepInfo, round_index: int, reduced: Mapping[str, torch.Tensor]) -> dict[str, Stat] | None:
        if round_index > 0:
            return None
        words = self._words if self._words is not None else choose_words(torch.zeros(0, dtype=torch.int64), 1)
        device = self.model.device
        stats: dict[str, Stat] = {}
        for i in range(self.layers):
            prefix = f"{PREFIX}layer_{i}/"
            stats |= self._stats.get(i) or empty_layer_stats(words, self.model.hidden_size, device, prefix)
        return batch_scope(stats)

    def train_metrics(self, step: StepInfo, reduced: Mapping[str, torch.Tensor]) -> dict[str, float] | None:
        out: dict[str, float] = {}
        parts = {f"{i}/{name}": value for i in range(self.layers)
                 for name, value in layer_parts(reduced, f"{PREFIX}layer_{i}/").items()}
        host = to_host(parts)  # the measurement's one read: a few numbers per word and layer
        for i in range(self.layers):
            prefix = f"{PREFIX}layer_{i}/"
            layer = {name: host[f"{i}/{name}"] for name in ("counts", "sq", "tt", "to", "intra_sum", "intra_count", "nonfinite")}
            nonfinite = int(layer["nonfinite"])
            if nonfinite:
                self._warn_once(
                    f"nonfinite{i}",
                    "aniso_plugins ethayarajh: block %d's output has %d non-finite entries at step %d; its metrics "
                    "are NaN while they remain. Training goes on.",
                    i,
                    nonfinite,
                    step.step,
                )
            out |= {prefix + key: value for key, value in finish_layer_parts(layer).items()}
        words = self._words
        out[PREFIX + "words"] = float(len(words.words)) if words is not None else 0.0
        out[PREFIX + "repeated_words"] = float(words.repeated) if words is not None else 0.0
        out[PREFIX + "baseline_pair_share"] = self._pair_share
        self._stats, self._words, self._pair_share = {}, None, float("nan")
        return out

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)


__all__ = ["EthayarajhPlugin"]
