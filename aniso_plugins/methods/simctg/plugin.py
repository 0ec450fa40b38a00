"""SimCTG's token-level contrastive loss (Su et al. 2022; `aniso_plugins.methods.simctg.loss`) as an
activation loss term, docs/methods.md §12.

``"simctg"`` in ``AnisoConfig.method`` builds one `SimCTGPlugin`. On every training micro-batch
it adds ``simctg_weight · L_CL`` on the LM head's input, with L_CL pooled over the valid pairs of
the micro-batch's **global** batch (every data-parallel rank's sequences): each rank returns
its share, the sum of its own pair losses divided by the global pair count, which
`aniso_targets` all-reduces (one int64 scalar per micro-batch). Under gradient accumulation each
micro-batch is one SimCTG batch and the step's term is the mean over its micro-batches (shares
divided by ``step.accumulation_steps``), as a trainer averages the micro-batches' MLE losses.
The core logs the step's term as ``aniso/loss/simctg`` (``simctg_weight`` times the mean of
the micro-batches' L_CL).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from aniso_plugins.core.config import AnisoConfig
from aniso_plugins.core.errors import SetupError
from aniso_plugins.core.hookspecs import hookimpl
from aniso_plugins.core.model import ModelHandle
from aniso_plugins.core.plugin_base import Plugin
from aniso_plugins.core.steps import StepInfo
from aniso_plugins.methods.simctg.loss import simctg_pair_count, simctg_pair_sums
from aniso_plugins.numerics.distributed import is_distributed


class SimCTGPlugin(Plugin):
    """Adds ``config.simctg_weight · L_CL`` (margin ``simctg_margin``, ``simctg_block`` query
    positions per block) on every training micro-batch; positions whose target is
    ``config.ignore_index`` (padding, the last position of a causal LM) take no part, and in a
    packed micro-batch (``step.sequence_ids``) pairs stay within one example."""

    name = "simctg"
    acts_in_head_forward = True

    def __init__(self, config: AnisoConfig) -> None:
        super().__init__(config)
        self._pair_count: torch.Tensor | None = None  # the current micro-batch's, over all ranks

    def setup(self, model: ModelHandle) -> None:
        if model.head_skips_label is not None:
            raise SetupError(
                f"simctg pairs the LM head's input positions within each sequence, but {type(model.model).__name__} "
                "runs its head on the labelled positions only (sparse_prediction=True): build the model with "
                "sparse_prediction=False to train SimCTG"
            )

    @hookimpl
    def aniso_targets(self, targets: torch.Tensor, step: StepInfo) -> None:
        count = simctg_pair_count(targets != self.config.ignore_index, step.sequence_ids)
        if is_distributed():  # collective-safe hook: every rank, every micro-batch
            dist.all_reduce(count, op=dist.ReduceOp.SUM, group=step.batch_group)
        self._pair_count = count

    @hookimpl
    def aniso_activation_loss_terms(
        self, hidden: torch.Tensor, targets: torch.Tensor, step: StepInfo
    ) -> dict[str, torch.Tensor]:
        count, self._pair_count = self._pair_count, None
        if count is None:
            raise RuntimeError(
                "simctg: activation loss terms before the micro-batch's aniso_targets (the adapter must call "
                "TrainingSession.begin_micro_batch(targets, ...) before the forward)"
            )
        cfg = self.config
        if targets.shape != hidden.shape[:-1]:
            raise ValueError(
                f"simctg: the LM head's input {tuple(hidden.shape)} and the targets {tuple(targets.shape)} are not "
                "aligned; expected hidden (..., T, d) and targets (..., T) of one micro-batch"
            )
        total, _ = simctg_pair_sums(
            hidden, targets != cfg.ignore_index, cfg.simctg_margin, cfg.simctg_block, step.sequence_ids
        )
        # no pair anywhere: total is a 0 still connected to `hidden` (a zero share, no division by 0)
        share = total * (cfg.simctg_weight / step.accumulation_steps) / count.clamp_min(1).to(total.dtype)
        return {self.name: share}


__all__ = ["SimCTGPlugin"]
