"""Unsupervised SimCSE (Gao, Yao & Chen 2021; `aniso_plugins.methods.simcse.contrastive`) as an activation loss
term, docs/methods.md §14.

``"simcse"`` in ``AnisoConfig.method`` builds one `SimCSEPlugin`. A forward hook on the last
transformer block (``ModelHandle.blocks()[-1]``) keeps that block's output of the current
training micro-batch (in the autograd graph); in the LM head's forward, after the encoder ran,
`aniso_activation_loss_terms` pools it (``simcse_pooling``) and returns the InfoNCE loss
(``simcse_temperature``) of the micro-batch's pairs: rows 2i and 2i + 1, which
`aniso_plugins.SimCSECollator` makes copies of one sentence. Negatives are the other pairs of the
same micro-batch on the same rank (no all-gather of activations). Each rank's share is
``simcse_weight · L_local / (world · accumulation_steps)``, so the step's term is the mean over
ranks and micro-batches of the per-rank InfoNCE. Without labels (pure unsupervised SimCSE) the
term is the whole loss (`TrainingSession.supplied_loss`); with MLM labels it is added to the MLM
loss.

Metrics (at measurement steps, from the pairs of the last measured micro-batch of each rank,
detached): ``simcse/alignment``, Wang & Isola's L_align (α = 2) of the two views, the mean over
all pairs of all ranks; ``simcse/uniformity``, L_uniform (t = ``uniformity_t``) of the first
views, log of the mean of exp(−t‖ẑ_i − ẑ_j‖²) over the ordered pairs i ≠ j of the same rank,
pooled over ranks (per-rank log-sum-exps and pair counts).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import torch

from aniso_plugins.core.config import AnisoConfig, ConfigError
from aniso_plugins.core.hookspecs import hookimpl
from aniso_plugins.core.model import ModelHandle, SetupError
from aniso_plugins.core.plugin_base import Plugin
from aniso_plugins.core.steps import StepInfo
from aniso_plugins.methods.simcse.contrastive import info_nce, pool
from aniso_plugins.methods.uniformity.kernels import alignment, uniformity
from aniso_plugins.numerics.reduce import Stat

logger = logging.getLogger("aniso_plugins")

_FIX = "batch the sentences with aniso_plugins.SimCSECollator(base_collator), which puts each one in rows 2i and 2i + 1"


class SimCSEPlugin(Plugin):
    """Adds ``config.simcse_weight · InfoNCE`` of the micro-batch's sentence pairs on every
    training micro-batch, and logs the alignment and uniformity of the pooled embeddings."""

    name = "simcse"
    acts_in_head_forward = True

    def __init__(self, config: AnisoConfig) -> None:
        super().__init__(config)
        self._want = False  # between a micro-batch's aniso_targets and its loss term
        self._output: torch.Tensor | None = None  # the last block's output of that micro-batch
        self._views: tuple[torch.Tensor, torch.Tensor] | None = None  # last measured pairs, detached
        self._packed: bool | None = None  # several sentences per row (checked on the first packed micro-batch)
        self._pairs_read = False  # the pairs' checks read back once (then at measurement steps)

    @hookimpl
    def aniso_supplies_loss(self) -> bool:
        """Unsupervised SimCSE has no token loss: a batch without MLM labels trains on InfoNCE alone."""
        return True

    def setup(self, model: ModelHandle) -> None:
        blocks = model.blocks()
        if not blocks:
            raise SetupError(
                "method='simcse' reads the last transformer block's output, but the model handle lists no blocks: "
                "build the ModelHandle with blocks='<path of the nn.ModuleList of blocks>'"
            )
        handle = blocks[-1].register_forward_hook(self._keep)
        model.on_restore(handle.remove)

    def _keep(self, module: torch.nn.Module, args, output) -> None:
        if not (self._want and module.training and torch.is_grad_enabled()):
            return  # evaluation, no_grad, or a recomputation in backward (activation checkpointing)
        x = output[0] if isinstance(output, tuple | list) else output
        if isinstance(x, torch.Tensor):
            self._output = x

    @hookimpl
    def aniso_targets(self, targets: torch.Tensor, step: StepInfo) -> None:
        self._want, self._output = True, None
        self._check_pairs(targets, step)

    def _check_pairs(self, targets: torch.Tensor, step: StepInfo) -> None:
        """Rows 2i and 2i + 1 must be one sentence: identical input ids when no position has a
        target (pure SimCSE), identical padding masks when there are MLM targets (the two copies
        are masked independently, so their ids differ where either is masked)."""
        ids, mask = step.input_ids, step.attention_mask
        if ids is None:
            raise SetupError(
                "method='simcse': this trainer adapter passes no input_ids, so the sentence pairs of a micro-batch "
                "cannot be checked; SimCSE needs an adapter with dict batches (HF Trainer, Lightning)"
            )
        if step.sequence_ids is not None and self._packed is None:  # once a run: a read back of the ids
            self._packed = bool((step.sequence_ids != step.sequence_ids[..., :1]).any())
        if self._packed:
            raise ConfigError(
                "method='simcse' with a packed micro-batch (several sentences per row, e.g. DataCollatorWithFlattening): "
                f"SimCSE pools one sentence per row; {_FIX}"
            )
        if ids.dim() != 2 or ids.shape[0] % 2:
            raise ConfigError(
                f"method='simcse': a micro-batch of input_ids {tuple(ids.shape)} is not (2N, T) pairs: {_FIX}"
            )
        cls_ok = mask[:, 0].all() if mask is not None and self.config.simcse_pooling == "cls" else ids.new_ones((), dtype=torch.bool)
        labelled = (targets != self.config.ignore_index).any()
        masks_same = (mask[0::2] == mask[1::2]).all() if mask is not None else cls_ok.new_ones(())
        same = masks_same & (labelled | (ids[0::2] == ids[1::2]).all())
        if self._pairs_read and not step.measure:  # checked on the device: no host read in a training step
            torch._assert_async(cls_ok & same, f"method='simcse': a micro-batch is not (2N, T) sentence pairs: {_FIX}")
            return
        self._pairs_read = True  # read back on the first micro-batch and at measurement steps, with the reason
        cls_ok, labelled, same = torch.stack([cls_ok, labelled, same]).tolist()
        if not cls_ok:
            raise ConfigError(
                "simcse_pooling='cls' reads position 0, but some rows are padding there (left padding): pad on the "
                "right (tokenizer.padding_side='right') or use simcse_pooling='mean'"
            )
        if not same:
            what = "padding masks" if labelled else "input_ids"
            raise ConfigError(f"method='simcse': rows 2i and 2i + 1 of a micro-batch have different {what}: {_FIX}")

    @hookimpl
    def aniso_activation_loss_terms(
        self, hidden: torch.Tensor, targets: torch.Tensor, step: StepInfo
    ) -> dict[str, torch.Tensor]:
        output, self._output, self._want = self._output, None, False
        if output is None:
            raise SetupError(
                "method='simcse': the last transformer block did not run in this micro-batch's forward (with grad, "
                "in train mode) before the LM head; SimCSE needs the encoder's last layer output"
            )
        ids = step.input_ids
        if output.dim() != 3 or tuple(output.shape[:2]) != tuple(ids.shape):
            raise SetupError(
                f"method='simcse': the last block's output {tuple(output.shape)} is not (batch, positions, hidden) "
                f"of the micro-batch's input_ids {tuple(ids.shape)}"
            )
        z = pool(output, step.attention_mask, self.config.simcse_pooling)
        z1, z2 = z[0::2], z[1::2]
        if step.measure:
            self._views = (z1.detach(), z2.detach())
        share = info_nce(z1, z2, self.config.simcse_temperature) * (
            self.config.simcse_weight / (step.batch_ranks * step.accumulation_steps)
        )
        return {self.name: share}

    def train_stats(self, step: StepInfo, round_index: int, reduced: Mapping[str, torch.Tensor]) -> dict[str, Stat] | None:
        if round_index > 0:
            return None
        views, self._views = self._views, None
        device = self.model.device  # one device class on every rank, measured or not
        zero = torch.zeros((), dtype=torch.float64, device=device)
        n = 0 if views is None else len(views[0])
        align_sum = alignment(*views).to(zero) * n if n else zero
        lse = zero - math.inf  # log of an empty sum
        if n > 1:
            lse = uniformity(views[0], self.config.uniformity_t).to(zero) + math.log(n * (n - 1))
        return {
            "simcse/align_sum": Stat(align_sum, over="batch"),
            "simcse/align_n": Stat(zero + n, over="batch"),
            "simcse/uniform_lse": Stat(lse, "lse", over="batch"),
            "simcse/uniform_pairs": Stat(zero + (n * (n - 1)), over="batch"),
        }

    def train_metrics(self, step: StepInfo, reduced: Mapping[str, torch.Tensor]) -> dict[str, float] | None:
        if "simcse/align_n" not in reduced:
            return None
        n, pairs = float(reduced["simcse/align_n"]), float(reduced["simcse/uniform_pairs"])
        out = {
            "simcse/alignment": float(reduced["simcse/align_sum"]) / n if n else math.nan,
            "simcse/uniformity": float(reduced["simcse/uniform_lse"]) - math.log(pairs) if pairs else math.nan,
        }
        for name, value in out.items():
            if not math.isfinite(value):
                logger.warning(
                    "aniso_plugins: %s is not finite at step %d (no measured pairs, or non-finite embeddings); logged as NaN",
                    name,
                    step.step,
                )
                out[name] = math.nan
        return out


__all__ = ["SimCSEPlugin"]
