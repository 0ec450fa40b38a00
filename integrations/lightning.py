"""Lightning adapter: one callback.

    from aniso_plugins import AnisoConfig
    from aniso_plugins.integrations.lightning import AnisoCallback

    trainer = lightning.Trainer(callbacks=[AnisoCallback(AnisoConfig(method="agg"))])

Finding the model's parts (the two knobs):

- the LM head: by default the first submodule of the LightningModule with the transformers
  API ``get_output_embeddings()`` (an HF model inside the module); otherwise name it:
  ``AnisoCallback(config, head="model.lm_head", input_embedding="model.embed",
  blocks="model.blocks")`` (submodule paths of the LightningModule);
- the targets: by default ``batch["labels"]`` shifted for a causal LM (position t predicts
  labels[t+1]); otherwise pass ``targets=lambda batch: ...`` returning ids aligned with the
  head's output positions (``config.ignore_index`` where no loss is taken).

How it maps onto Lightning 2.6 (shared/docs/hf-and-lightning.md, Part B): head surgery in
``setup`` (before ``configure_model``, wrapping and optimizers); targets in
``on_train_batch_start``; loss terms attached in the head's forward on the last micro-batch of
each optimizer step (before clipping, once per step under ``accumulate_grad_batches``; DDP and
FSDP2 average identical per-rank terms); metrics measured on every rank after the optimizer
step when Lightning will write logs (or every ``config.metrics_every`` steps) and logged with
``log_dict(sync_dist=False)`` because the core already reduced them; plugin state in the
checkpoint through ``state_dict`` / ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import AnisoConfig, SetupError
from ..model import find_handle
from ..session import TrainingSession, causal_targets

try:
    import lightning.pytorch as pl
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError('aniso_plugins.integrations.lightning needs lightning: pip install "aniso-plugins[lightning]"') from e

_VAL_PREFIX = "val_"


class AnisoCallback(pl.Callback):
    """Runs aniso_plugins methods and metrics inside a `lightning.Trainer`.

    config: the `AnisoConfig`; plugins: extra plugin objects.
    head / input_embedding / blocks: submodule paths in the LightningModule (default: find a
        module with ``get_output_embeddings()``).
    targets: batch -> targets aligned with the head's outputs (default: causal shift of
        ``batch["labels"]``).
    """

    def __init__(
        self,
        config: AnisoConfig | None = None,
        plugins: Iterable[object] = (),
        *,
        head: str | None = None,
        input_embedding: str | None = None,
        blocks: str | None = None,
        targets: Callable[[Any], torch.Tensor] | None = None,
    ) -> None:
        self.session = TrainingSession(config, plugins)
        self.config = self.session.config
        self._paths = dict(head=head, input_embedding=input_embedding, blocks=blocks)
        self._targets = targets or self._labels_shifted
        self._stepped_at: int | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(method=self.config.method, head=self.config.head)

    def _labels_shifted(self, batch: Any) -> torch.Tensor:
        if not isinstance(batch, dict) or "labels" not in batch:
            raise SetupError(
                "AnisoCallback: the batch is not a dict with 'labels'; pass targets=lambda batch: ... returning "
                "the next-token ids aligned with the LM head's output"
            )
        return causal_targets(batch["labels"], self.config.ignore_index)

    # --- set-up -----------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.session.handle is not None:
            return
        if not pl_module.automatic_optimization:
            raise SetupError("AnisoCallback needs automatic optimization (manual optimization is not supported)")
        self.session.setup(find_handle(pl_module, **self._paths))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            self.session.epoch_steps = -(-trainer.num_training_batches // trainer.accumulate_grad_batches)
        except (TypeError, OverflowError):  # infinite or unknown length
            self.session.epoch_steps = None

    # --- training ---------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        acc, total = trainer.accumulate_grad_batches, trainer.num_training_batches
        window_start = batch_idx - batch_idx % acc
        window = acc if total == float("inf") else min(acc, int(total) - window_start)
        last = batch_idx - window_start == window - 1
        step = trainer.global_step + 1
        # 16-mixed AMP: backward runs on the scaled loss, so loss terms get the same scale
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.session.loss_scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0
        self.session.begin_micro_batch(
            self._targets(batch), step=step, accumulation_steps=window, measure=last and self._due(trainer, step)
        )
        self._stepped_at = step if last else None

    def _due(self, trainer: pl.Trainer, step: int) -> bool:
        """Measure when Lightning writes this step's logs (every ``log_every_n_steps``
        optimizer steps), or every ``config.metrics_every`` steps."""
        every = trainer.log_every_n_steps
        return self.session.plugins.metrics_due(step, bool(every) and step % every == 0)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        step = self._stepped_at
        if step is None or trainer.global_step != step:  # no optimizer step after this micro-batch
            return
        self.session.end_step(step)
        if self._due(trainer, step):
            metrics = self.session.measure(step)
            if metrics:
                pl_module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False, batch_size=1)
            self.session.plugins.log(metrics, step)

    # --- evaluation -------------------------------------------------------------------------
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking:
            self.session.eval_targets = self._targets(batch)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.session.eval_targets = None

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        metrics = self.session.measure(trainer.global_step, kind="eval")
        if metrics:
            pl_module.log_dict({_VAL_PREFIX + k: v for k, v in metrics.items()}, sync_dist=False, batch_size=1)

    # --- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.session.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.session.load_state_dict(state_dict)


__all__ = ["AnisoCallback"]
