"""Evaluation metrics per frequency group: perplexity and Uniq (AGG paper, Yu et al. 2022, §4;
Uniq of Welleck et al. 2020; docs/methods.md §1.8, §6).

Over the positions of the evaluation batches whose target is not ``config.ignore_index``:

- ``eval/ppl`` = exp(Σ NLL / #positions) (natural log; equal to the official 2^(mean bits));
  ``eval/ppl_<group>`` the same over positions whose **target** is in the group;
- ``eval/uniq`` = number of distinct argmax next-token predictions; ``eval/uniq_<group>`` the
  number of those predicted ids that belong to the group (the union over ranks, not a sum).

Groups (rare / medium / frequent) come from `aniso_plugins.metrics.frequency.groups.frequency_groups` over the shared counts
of training targets (`TargetCountsPlugin`), applied when the measurement is finished.
Uniq depends on segment length, split and vocabulary: not comparable across papers (§6).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from aniso_plugins.core.config import AnisoConfig
from aniso_plugins.core.hookspecs import hookimpl
from aniso_plugins.core.plugin_base import Plugin
from aniso_plugins.core.steps import StepInfo
from aniso_plugins.metrics.frequency.groups import GROUPS, frequency_groups
from aniso_plugins.metrics.frequency.target_counts import TargetCountsPlugin
from aniso_plugins.numerics.host_copy import to_host
from aniso_plugins.numerics.linalg import ROW_BLOCK
from aniso_plugins.numerics.reduce import Stat


class EvalPlugin(Plugin):
    """Accumulates per-target-id NLL sums and counts and the set of argmax predictions over the
    evaluation batches (`aniso_eval_batch`), finishes them at ``aniso_metrics(kind="eval")`` and
    resets. It measures the "eval" kind, so it declares `aniso_metric_stats` and `aniso_metrics`
    itself (the base's train measurement does not apply)."""

    name = "eval"
    summary = {"ppl": "eval/ppl", "ppl rare": "eval/ppl_rare"}

    def __init__(self, config: AnisoConfig, counts: TargetCountsPlugin) -> None:
        super().__init__(config)
        self.counts = counts
        self._nll: torch.Tensor | None = None
        self._tokens: torch.Tensor | None = None
        self._predicted: torch.Tensor | None = None

    def _reset(self, device: torch.device) -> None:
        v = self.counts.ready().vocab_size
        self._nll = torch.zeros(v, dtype=torch.float64, device=device)
        self._tokens = torch.zeros(v, dtype=torch.float64, device=device)
        self._predicted = torch.zeros(v, dtype=torch.bool, device=device)

    @hookimpl
    def aniso_eval_batch(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        v = self.counts.ready().vocab_size
        if logits.shape[-1] != v or targets.shape != logits.shape[:-1]:
            raise ValueError(
                f"EvalPlugin: expected logits (..., T, {v}) and targets (..., T), got logits "
                f"{tuple(logits.shape)} and targets {tuple(targets.shape)}"
            )
        if self._nll is None:
            self._reset(logits.device)
        z = logits.detach().reshape(-1, v)
        y = targets.reshape(-1).to(z.device)
        keep = y != self.config.ignore_index
        z, y = z[keep], y[keep]
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= v):
            raise ValueError(f"targets must lie in [0, {v}) or equal ignore_index={self.config.ignore_index}")
        dtype = torch.promote_types(z.dtype, torch.float32)
        for start in range(0, y.numel(), ROW_BLOCK):
            zc, yc = z[start : start + ROW_BLOCK].to(dtype), y[start : start + ROW_BLOCK]
            nll = torch.logsumexp(zc, dim=-1) - zc.gather(1, yc[:, None]).squeeze(1)
            self._nll.index_add_(0, yc, nll.double())
            self._tokens.index_add_(0, yc, torch.ones_like(nll, dtype=torch.float64))
            self._predicted[zc.argmax(dim=-1)] = True

    @hookimpl
    def aniso_metric_stats(
        self, step: StepInfo, kind: str, round_index: int, reduced: Mapping[str, torch.Tensor]
    ) -> dict[str, Stat] | None:
        if kind != "eval" or round_index > 0:
            return None
        if self._nll is None:
            self._reset(self.counts.ready().counts.device)
        return {
            "eval/nll": Stat(self._nll, over="batch"),
            "eval/tokens": Stat(self._tokens, over="batch"),
            "eval/predicted": Stat(self._predicted, "max", over="batch"),
        }

    @hookimpl
    def aniso_metrics(
        self, step: StepInfo, kind: str, reduced: Mapping[str, torch.Tensor]
    ) -> dict[str, float] | None:
        if kind != "eval":
            return None
        groups = frequency_groups(self.counts.ready().counts, self.config.group_fractions,
                                  seen_only=self.config.group_tokens == "seen")
        host = to_host({"nll": reduced["eval/nll"], "tokens": reduced["eval/tokens"], "predicted": reduced["eval/predicted"],
                        "groups": groups})  # the measurement's one read: the rest is host arithmetic
        nll, tokens, predicted, groups = host["nll"], host["tokens"], host["predicted"], host["groups"]
        out = {"eval/ppl": _perplexity(nll.sum(), tokens.sum()), "eval/uniq": float(predicted.sum())}
        for index, group in enumerate(GROUPS):
            member = groups == index
            out[f"eval/ppl_{group}"] = _perplexity(nll[member].sum(), tokens[member].sum())
            out[f"eval/uniq_{group}"] = float((predicted & member).sum())
        self._nll = self._tokens = self._predicted = None
        return out


def _perplexity(nll_sum: torch.Tensor, count: torch.Tensor) -> float:
    return float(torch.exp(nll_sum / count)) if float(count) > 0 else math.nan


__all__ = ["EvalPlugin"]
