"""Lightning adapter: one callback.

    from aniso_plugins import AnisoConfig
    from aniso_plugins.integrations.lightning import AnisoCallback

    trainer = lightning.Trainer(callbacks=[AnisoCallback(AnisoConfig(method="agg"))])

Finding the model's parts (the two knobs):

- the LM head: by default the first submodule of the LightningModule with the transformers
  API ``get_output_embeddings()`` (an HF model inside the module); otherwise name it:
  ``AnisoCallback(config, head="model.lm_head", input_embedding="model.embed",
  blocks="model.blocks")`` (submodule paths of the LightningModule);
- the targets: by default as the found HF model's own loss aligns ``batch["labels"]``
  (`aniso_plugins.models.alignment.alignment_of`: shifted for a causal LM, or ``batch["shift_labels"]``;
  as they are for a masked LM and for an encoder-decoder's decoder); a head named by path
  needs ``targets="causal"`` / ``"aligned"`` / ``"seq2seq"``, or ``targets=lambda batch: ...``
  returning ids aligned with the head's output positions (``config.ignore_index`` where no
  loss is taken). Packed batches: ``batch["position_ids"]`` restarting at each example (or
  ``seq_idx`` / ``cu_seq_lens_q``) keeps SimCTG's pairs and IntraSim's sentences inside one
  example.

How it maps onto Lightning 2.6 (docs/design.md walks through it): head surgery in
``setup`` (before ``configure_model``, wrapping and optimizers); the run's facts (epoch
length, accumulation, the 16-mixed grad scaler) in ``on_train_start``; targets in
``on_train_batch_start`` (where a plugin reads each optimizer step's whole batch, AGG, the first
micro-batch of a step also announces the step's other ones, read ahead from the fit loop's
batch iterator, `_StepLookahead`); loss terms attached in the head's forward on the last micro-batch of
each optimizer step (before clipping, once per step under ``accumulate_grad_batches``; DDP and
FSDP2 average identical per-rank terms); metrics measured on every rank after the optimizer
step when Lightning will write logs (or every ``config.metrics_every`` steps) and logged with
``log_dict(sync_dist=False)`` because the core already reduced them; plugin state in the
checkpoint through ``state_dict`` / ``load_state_dict``.

Strategies, each equal to one process on the same global batch (tests/test_lightning.py,
tests/test_lightning_strategies.py): DDP; ``ModelParallelStrategy`` (FSDP2; a tensor-parallel LM
head is refused before the first step); ``FSDPStrategy`` (FSDP1, flat parameters too) and
``DeepSpeedStrategy`` ZeRO-1/2/3 (offloaded too), whose partitioned head and embedding are read
whole between steps (``engine_root=trainer.model``). Under DeepSpeed the loss terms are scaled as
its ``backward`` scales the loss: by its fp16 loss scale, and by 1/``accumulate_grad_batches``
once more than elsewhere (Lightning and DeepSpeed both divide the loss by it: every gradient is
that much smaller than under DDP, Lightning's own behaviour). The head and the embedding must
exist when ``setup`` runs (built in ``__init__``, not in ``configure_model``).

The fused loss (``fused_loss``; docs/methods.md §16), in one of two routes:

- the module's own loss: a LightningModule that declares ``aniso_loss_fn = None`` gets it set
  to `AnisoCallback.loss_fn` and returns ``self.aniso_loss_fn(hidden)`` (the head's input; the
  targets are the batch's, read by the callback): the mean token cross-entropy, computed in
  the head chunk by chunk (AGG-gated with AGG; by default with AGG, or always with
  ``fused_loss=True``) or, without the fused loss, from the head's logits;
- an HF causal LM inside the module whose ``outputs.loss`` is the training loss: with
  ``fused_loss=True``, as in the HF adapter (the model's ``loss_function`` takes the head's
  fused sum). Not by default: the module may read ``outputs.logits`` in training, which are
  then the 0-dim loss.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from aniso_plugins import (
    AnisoConfig, DeepSpeedLossScale, ModelHandle, OutputEmbeddingsHandle, ParallelLayout, SetupError, TargetRule, TrainingSession, alignment_of,
    find_handle, target_rule,
)
from aniso_plugins.models.causal_loss import install_fused_causal_loss, why_loss_is_not_reproduced

try:
    import lightning.pytorch as pl
    from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy
    from lightning.pytorch.utilities.model_helpers import is_overridden
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError('aniso_plugins.integrations.lightning needs lightning: pip install "aniso-plugins[lightning]"') from e

_VAL_PREFIX = "val_"


def _optimizer_flat(strategy: object) -> str | None:
    """Why `strategy`'s optimizer steps flat buffers, not the model's parameters (`ParallelLayout.optimizer_flat`)."""
    if isinstance(strategy, DeepSpeedStrategy):
        return ("DeepSpeedStrategy's ZeRO optimizer steps fp32 master copies in flat partitions of the parameters, not "
                "the model's rows: use DDPStrategy or ModelParallelStrategy (FSDP2)")
    if isinstance(strategy, FSDPStrategy):
        return ("FSDPStrategy (FSDP1) flattens the parameters into buffers sharded by elements, not rows: use "
                "ModelParallelStrategy (FSDP2)")
    return None


class AnisoCallback(pl.Callback):
    """Runs aniso_plugins methods and metrics inside a `lightning.Trainer`.

    config: the `AnisoConfig`; plugins: extra plugin objects.
    head / input_embedding / blocks: submodule paths in the LightningModule (default: find a
        module with ``get_output_embeddings()``).
    targets: how a batch's targets align with the head's outputs: None (as the found HF
        model's loss aligns ``batch["labels"]``), "causal", "aligned", "seq2seq", or a
        function batch -> ids aligned with the head's outputs.
    """

    def __init__(
        self,
        config: AnisoConfig | None = None,
        plugins: Iterable[object] = (),
        *,
        head: str | None = None,
        input_embedding: str | None = None,
        blocks: str | None = None,
        targets: Callable[[Any], torch.Tensor] | str | None = None,
    ) -> None:
        self.session = TrainingSession(config, plugins)
        self.config = self.session.config
        self._paths = dict(head=head, input_embedding=input_embedding, blocks=blocks)
        self._targets = targets
        self._rule: TargetRule | None = None
        self._stepped_at: int | None = None
        self._window: tuple[int, int] | None = None  # (step, its micro-batches)
        self._module_loss = False  # the LightningModule declares aniso_loss_fn
        self._batch_targets: torch.Tensor | None = None  # the current batch's, for loss_fn
        self._eval_batch = contextlib.ExitStack()  # session.evaluating(...) from batch start to end

    @property
    def state_key(self) -> str:
        return self._generate_state_key(method="+".join(self.config.method), head=self.config.head)

    def _read(self, batch: Any):
        read = self._rule.read(batch, self.config.ignore_index)
        if read.targets is None:
            raise SetupError(
                "AnisoCallback: the batch is not a dict with 'labels' (or 'shift_labels'); pass "
                "targets=lambda batch: ... returning the next-token ids aligned with the LM head's output"
            )
        return read

    # --- set-up -----------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.session.handle is not None:
            return
        if not pl_module.automatic_optimization:
            raise SetupError("AnisoCallback needs automatic optimization (manual optimization is not supported)")
        try:
            handle = find_handle(pl_module, **self._paths)
        except SetupError as e:
            if not is_overridden("configure_model", pl_module, pl.LightningModule):
                raise
            raise SetupError(
                f"{e} (AnisoCallback sets up before configure_model: build the LM head and the input embedding in "
                "the LightningModule's __init__; configure_model may then shard them, and DeepSpeed ZeRO-3 "
                "partitions them when it starts)"
            ) from e
        rule = target_rule(self._targets, (lambda: alignment_of(handle.model)) if isinstance(handle, OutputEmbeddingsHandle) else None)
        self._module_loss = hasattr(type(pl_module), "aniso_loss_fn")
        why_not = None if self._module_loss else self._why_model_loss_is_not_owned(handle)
        layout = ParallelLayout(optimizer_flat=_optimizer_flat(trainer.strategy))
        self.session.setup(handle, layout, owns_loss=why_not is None, why_not=why_not or "")
        if self.session.head_computes_loss and not self._module_loss:
            handle.on_restore(install_fused_causal_loss(handle.model, self.config.ignore_index))
        if self._module_loss:
            pl_module.aniso_loss_fn = self.loss_fn
            handle.on_restore(lambda: setattr(pl_module, "aniso_loss_fn", None))
        self._rule = rule

    def _why_model_loss_is_not_owned(self, handle: ModelHandle) -> str | None:
        """Why the fused loss cannot be the loss of an HF model inside the module, or None."""
        if not isinstance(handle, OutputEmbeddingsHandle):
            return "the LightningModule computes its own loss: declare aniso_loss_fn = None on it and return self.aniso_loss_fn(hidden)"
        if self.config.fused_loss is not True:
            return (
                "the LightningModule may read its model's training logits: declare aniso_loss_fn = None on it and "
                "return self.aniso_loss_fn(hidden), or set fused_loss=True if it uses only outputs.loss"
            )
        return why_loss_is_not_reproduced(handle.model, self.config.ignore_index)

    def loss_fn(self, hidden: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The token loss of `hidden`, the LM head's input at every position (..., d), against
        the batch's targets aligned with the head's outputs (`targets`, or None: those the
        callback read from the current batch, e.g. the shifted labels of a causal LM with
        ``ignore_index`` at the last position): Σ_{i: y_i ≠ ignore_index} CE_i / (their number),
        as ``F.cross_entropy``. In a training micro-batch with the fused loss it is the head's
        fused chunked loss (no logits); otherwise the cross-entropy of the head's float32 logits."""
        head = self.session.handle.head()
        batch_targets = self._batch_targets
        if targets is None:
            if batch_targets is None:
                raise SetupError("AnisoCallback.loss_fn: no batch was read (call it inside training_step / validation_step)")
            targets = batch_targets
        elif batch_targets is not None and not torch.equal(targets.to(batch_targets.device), batch_targets):
            raise SetupError(
                "AnisoCallback.loss_fn: the targets are not those read from this batch (the callback's targets= rule, "
                "aligned with the LM head's outputs): pass the same ids, or none"
            )
        if self.session.head_computes_loss and head.training and torch.is_grad_enabled():
            return head(hidden)
        logits = head(hidden)
        flat = logits.reshape(-1, logits.shape[-1]).float()
        return F.cross_entropy(flat, targets.reshape(-1).to(logits.device), ignore_index=self.config.ignore_index)

    def detach(self, keep_head: bool = False) -> None:
        """Undo what this callback did to the model: its forwards, hooks, head and tying are
        exactly as before `setup` (`keep_head=True` keeps a replaced or untied head, whose
        trained Parameters are the run's result). Lightning's ``teardown`` after ``fit`` calls
        it with ``keep_head=True``, so the same model can be fitted again with a new callback."""
        self.session.detach(keep_head=keep_head)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.session.end_training(trainer.default_root_dir, main_process=trainer.is_global_zero)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.detach(keep_head=True)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._refuse_tensor_parallel_head()
        if not isinstance(trainer.fit_loop._data_fetcher, _PrefetchDataFetcher):
            self.detach()
            raise SetupError(
                "the LightningModule's training_step takes the dataloader iterator (it fetches its batches itself): "
                "AnisoCallback reads each training batch's targets before its forward (AGG: every batch of an "
                "optimizer step before the first), which Lightning then does not hand to callbacks; take `batch` in "
                "training_step"
            )
        acc = trainer.accumulate_grad_batches
        loss_scale, grad_scaler = 1.0, getattr(trainer.precision_plugin, "scaler", None)  # 16-mixed AMP
        if isinstance(trainer.strategy, DeepSpeedStrategy):
            # Lightning divides each micro-batch's loss by accumulate_grad_batches and DeepSpeed's
            # engine.backward once more by its gradient_accumulation_steps, then scales it (fp16)
            loss_scale, grad_scaler = 1.0 / trainer.model.gradient_accumulation_steps(), DeepSpeedLossScale(trainer.model)
        self.session.begin_training(
            epoch_steps=self.session.epoch_length(trainer.num_training_batches, acc),
            start_step=trainer.global_step,
            accumulation_steps=acc,
            loss_scale=loss_scale,
            grad_scaler=grad_scaler,
            engine_root=trainer.model,  # FSDPStrategy's root FullyShardedDataParallel (FSDP1), DeepSpeed's engine, ...
            optimizers=tuple(trainer.optimizers),
        )

    def _refuse_tensor_parallel_head(self) -> None:
        """`ModelParallelStrategy` with ``tensor_parallel_size > 1`` whose ``configure_model``
        made the LM head tensor-parallel: its weight stays a ``tensor_parallel`` DTensor inside
        the forward, which the methods and metrics here do not read shard by shard. Refused
        before the first step, the model left as it was (torchtitan's adapter does TP)."""
        from torch.distributed.tensor import DTensor

        weight = self.session.handle.head().weight if self.session.handle is not None else None
        if not isinstance(weight, DTensor):
            return
        names = weight.device_mesh.mesh_dim_names or ()
        sharded = [n for n, p in zip(names, weight.placements) if n == "tensor_parallel" and not p.is_replicate()]
        if sharded:
            self.detach()
            raise SetupError(
                f"the LM head's weight is tensor-parallel ({weight.placements} on {names}): the Lightning adapter "
                "reads the head whole inside its forward (the DDP and FSDP2 layouts); leave the LM head out of the "
                "plan your configure_model gives parallelize_module (tensor-parallel blocks are fine), or train with "
                "torchtitan, whose adapter has the vocabulary-parallel head"
            )

    # --- training ---------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        acc, total = trainer.accumulate_grad_batches, trainer.num_training_batches
        offset = batch_idx % acc
        step = trainer.global_step + 1
        read = self._read(batch)
        if offset == 0 or self._window is None or self._window[0] != step:
            window = acc if total == float("inf") else min(acc, int(total) - (batch_idx - offset))
            if offset == 0 and self.session.wants_step_targets and window > 1:
                # the optimizer step's other micro-batches, before this one's forward
                ahead = [self._read(b) for b in _StepLookahead.of(trainer).peek(window - 1)]
                window = 1 + len(ahead)  # shorter where an iterable dataset ends
                self.session.begin_step([read, *ahead], step=step)
            self._window = (step, window)
        window = self._window[1]
        last = offset == window - 1
        self._batch_targets = read.targets if self._module_loss else None
        self.session.begin_micro_batch(
            read,
            step=step,
            accumulation_steps=window,
            measure=self._due(trainer, step),
            loss_normalizer=(read.targets != self.config.ignore_index).sum() if self._module_loss else None,
        )
        self._stepped_at = step if last else None

    def _due(self, trainer: pl.Trainer, step: int) -> bool:
        """Measure when Lightning writes this step's logs (every ``log_every_n_steps``
        optimizer steps), or every ``config.metrics_every`` steps."""
        every = trainer.log_every_n_steps
        return self.session.measures_at(step, bool(every) and step % every == 0)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        step = self._stepped_at
        if step is None or trainer.global_step != step:  # no optimizer step after this micro-batch
            return
        self.session.end_step(step)
        if self._due(trainer, step):
            log = lambda m: self._log(pl_module, m, "", on_step=True, on_epoch=False)  # noqa: E731
            self.session.measure_and_log(step, "train", log)

    def _log(self, pl_module: pl.LightningModule, metrics: dict[str, float], prefix: str, **when: bool) -> None:
        """Every metric to the loggers, and the plugins' summary values (`TrainingSession.summary`)
        to the progress bar only."""
        pl_module.log_dict(metrics, sync_dist=False, batch_size=1, **when)
        summary = {prefix.replace("_", " ") + label: v for label, v in self.session.summary(metrics, prefix).items()}
        if summary:
            pl_module.log_dict(summary, prog_bar=True, logger=False, sync_dist=False, batch_size=1, **when)

    # --- evaluation -------------------------------------------------------------------------
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self._module_loss:
            self._batch_targets = self._read(batch).targets
        if not trainer.sanity_checking and self.session.wants_eval_batches:
            self._eval_batch.enter_context(self.session.evaluating(self._read(batch).targets))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._eval_batch.close()

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        log = lambda m: self._log(pl_module, m, _VAL_PREFIX)  # noqa: E731
        self.session.measure_and_log(trainer.global_step, "eval", log, prefix=_VAL_PREFIX)

    # --- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.session.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.session.load_state_dict(state_dict)


class _StepLookahead(Iterator):
    """The fit loop's batch iterator (its data fetcher's ``iterator``), wrapped so that `peek`
    can read the batches of an optimizer step ahead of Lightning: `peek(n)` returns the next n
    batches as the DataLoader gives them (before ``on_before_batch_transfer`` and the device
    transfer), and the fetcher then gets exactly those, in order."""

    def __init__(self, fetcher: Any) -> None:
        self.fetcher, self.iterator = fetcher, fetcher.iterator
        self.buffer: deque = deque()

    @classmethod
    def of(cls, trainer: pl.Trainer) -> _StepLookahead:
        """The lookahead of the running fit loop's fetcher (installed on first use, and again
        when the fetcher makes a new iterator, at each epoch)."""
        fetcher = trainer.fit_loop._data_fetcher  # a _PrefetchDataFetcher (on_train_start refuses the others)
        if not isinstance(fetcher.iterator, cls):
            fetcher.iterator = cls(fetcher)
        return fetcher.iterator

    def __next__(self) -> Any:
        return self.buffer.popleft() if self.buffer else next(self.iterator)

    def peek(self, n: int) -> list[Any]:
        """Up to `n` next batches: those the fetcher has prefetched (a DataLoader without a
        length), then those read ahead here (fewer where the data ends)."""
        held = list(self.fetcher.batches)[:n]
        while len(held) + len(self.buffer) < n:
            try:
                self.buffer.append(next(self.iterator))
            except StopIteration:
                break
        items = held + list(self.buffer)[: n - len(held)]
        return [batch for batch, _, _ in items]  # the iterator gives (batch, batch_idx, dataloader_idx)


__all__ = ["AnisoCallback"]
