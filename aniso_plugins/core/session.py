"""The one object a trainer adapter talks to: a training run's plugins plus the bookkeeping
every adapter needs between its trainer's events and the hooks.

An adapter translates its trainer's events into these calls, and nothing else::

    session = TrainingSession(config, plugins)
    session.setup(handle, layout, owns_loss=..., why_not=...)   before the model is wrapped
    session.begin_training(epoch_steps=..., start_step=..., accumulation_steps=...,
                           loss_scale=..., grad_scaler=..., label_smoothing=..., engine_root=...)
    session.load_state_dict(...) / session.load(dir)      when resuming (before or after begin_training)
    session.begin_step(batches, step=...)        where `wants_step_targets`: every micro-batch of the
                                                 step, before the first forward
    session.begin_micro_batch(targets, step=..., ...)     each training micro-batch, before its forward
    (forward: the head's forward hook attaches the loss terms on the micro-batch they are due,
     and each micro-batch's activation-dependent terms; an adapter whose loss calls the head
     on chunks calls session.attach_activation_terms(hidden) on the whole micro-batch first)
    loss = session.supplied_loss()               batches without labels, when supplies_loss
    session.end_step(step)                       after the optimizer step
    session.measure_and_log(step, "train", sink) at steps where `measures_at` says so, every rank
    with session.evaluating(targets): ...       around each evaluation batch's forward
    session.measure_and_log(step, "eval", sink) after the evaluation loop

The session numbers micro-batches within a step, decides when loss terms and metrics are due,
attaches loss terms inside the head's forward (`aniso_plugins.core.loss.attach_loss`) with the
adapter's gradient scale (and the fp16 grad scaler's), and feeds the head's evaluation output to
the plugins, so adapters hold no bookkeeping and no method math. The run's `ParallelLayout`,
given once at set-up, is held here: its world is in force around each call
(`aniso_plugins.numerics.distributed.in_world`), never a process-wide setting. docs/design.md
follows one micro-batch through each adapter.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from aniso_plugins.core.config import AnisoConfig, ConfigError
from aniso_plugins.core.errors import StateError
from aniso_plugins.core.layout import ParallelLayout
from aniso_plugins.core.loss import attach_loss, zero_through
from aniso_plugins.core.loss_scale import GradScaler, amp_scale
from aniso_plugins.core.model import ModelHandle, SetupError, guard_module_hooks
from aniso_plugins.core.plugins import AnisoPlugins
from aniso_plugins.core.state import RESET_HINT, check_compatible, load_state, remove_stale_temporaries
from aniso_plugins.core.steps import RunInfo, StepInfo, TargetChunks, optimizer_steps_per_epoch
from aniso_plugins.core.targets import MicroBatchTargets
from aniso_plugins.numerics.distributed import in_world, rank_and_world

logger = logging.getLogger("aniso_plugins")

MetricsSink = Callable[[dict[str, float]], Any]
"""Where an adapter hands finished metrics: its trainer's own logger."""


def _in_world(method: Callable) -> Callable:
    """`method` of the session, run with the session's layout's world in force."""

    @functools.wraps(method)
    def in_layout_world(self: TrainingSession, *args, **kwargs):
        with in_world(self.layout.world):
            return method(self, *args, **kwargs)

    return in_layout_world


class TrainingSession:
    """One training run's plugins plus the adapter-side bookkeeping.

    config / plugins: as for `AnisoPlugins`.
    """

    def __init__(self, config: AnisoConfig | None = None, plugins: Iterable[object] = ()) -> None:
        self.plugins = AnisoPlugins(config, plugins)
        self.config = self.plugins.config
        self._head_computes_loss = False
        self._supplies_loss = self.plugins.supplies_loss()
        self.handle: ModelHandle | None = None
        self.run: RunInfo | None = None
        self._loss_scale = 1.0
        self._grad_scaler: GradScaler | None = None
        self.layout = ParallelLayout()
        self._micro_batch = 0
        self._current: StepInfo | None = None
        self._loss_due = False
        self._activations_due = False
        self._targets: torch.Tensor | None = None
        self._head_input: torch.Tensor | None = None
        self._supplied: torch.Tensor | None = None
        self._supplying = False
        self._eval: TargetChunks | None = None
        self._eval_paused = False
        self._pending_state: tuple[Mapping[str, Mapping[str, torch.Tensor]], str] | None = None  # (state, where)

    # --- what the adapter asks ----------------------------------------------------------------
    @property
    def head_computes_loss(self) -> bool:
        """Whether the LM head returns a training micro-batch's loss itself (a 0-dim tensor: the
        summed token loss divided by the micro-batch's ``loss_normalizer``, or the sum) instead of
        logits: decided at `setup` (`aniso_head_computes_loss`), only where the adapter owns the
        loss and no plugin reads the training logits."""
        return self._head_computes_loss

    @property
    def uses_head_forward(self) -> bool:
        """Whether a plugin acts in the LM head's training forward or reads its logits."""
        return bool(self.plugins.in_head_forward() or self.plugins.reads_training_logits())

    @property
    def supplies_loss(self) -> bool:
        """Whether a training batch without labels is trained on the plugins' loss terms alone (a
        plugin says so, `aniso_supplies_loss`: unsupervised SimCSE has no token loss); the
        adapter then announces it with ``begin_micro_batch(..., supplies_loss=True)``, runs the
        forward and backpropagates `supplied_loss()` instead of the model's loss."""
        return self._supplies_loss

    @property
    def wants_step_targets(self) -> bool:
        """Whether a plugin reads each optimizer step's whole batch before its first forward
        (`aniso_step_targets`: AGG's token counter): the adapter then announces every step with
        `begin_step` before its first micro-batch (a step of one micro-batch may go without)."""
        return self.plugins.implements("aniso_step_targets")

    @property
    def wants_eval_batches(self) -> bool:
        """Whether any plugin reads evaluation batches (adapters may skip `evaluating` if not)."""
        return self.plugins.implements("aniso_eval_batch")

    def measures_at(self, step: int, trainer_logs: bool) -> bool:
        """Whether metrics are measured after optimizer step `step`: every
        ``config.metrics_every`` steps, or at the trainer's own logging steps (`trainer_logs`)
        when that is None."""
        every = self.config.metrics_every
        return trainer_logs if every is None else step % every == 0

    # --- set-up -----------------------------------------------------------------------------
    def setup(
        self, handle: ModelHandle, layout: ParallelLayout | None = None, *, owns_loss: bool = False, why_not: str = ""
    ) -> None:
        """Hold the run's parallel `layout` (default: one process or plain data parallelism),
        refuse it where a plugin cannot serve it (`aniso_refuse_layout`), run the plugins' set-up
        (head surgery, model-dependent checks), decide `head_computes_loss`, hook the final head's
        output (loss terms, evaluation batches) and make ``torch.compile`` see the hooks
        (`guard_module_hooks`). Once, before the model is wrapped.

        owns_loss: whether the adapter can take the training loss from the head and reproduce
            the model's own loss exactly (the fused loss); why_not: if not, why (for messages).

        Transactional: if any plugin's set-up raises, everything the others did to the model is
        undone (`ModelHandle.restore`) before the error propagates."""
        if self.handle is not None:
            raise SetupError("TrainingSession.setup was already called for this run: call detach() first")
        guard_module_hooks()
        layout = layout if layout is not None else ParallelLayout()
        self.check_layout(layout)
        bypassed = self.plugins.bypass_refusal(handle)
        if bypassed is not None:
            raise SetupError(bypassed)
        self.layout = handle.layout = layout
        try:
            with in_world(layout.world), handle.full_weights():  # a model an engine built partitioned (ZeRO-3's zero.Init)
                self.plugins.setup(handle)
            self._head_computes_loss = self.plugins.head_computes_loss(*self.plugins.loss_ownership(handle, owns_loss, why_not))
            head = handle.head()
            # prepended: the activation terms see the head's input before any probe replaces it
            pre = head.register_forward_pre_hook(self._on_head_input, prepend=True)
            handle.on_restore(pre.remove)
            hook = head.register_forward_hook(self._on_head_output)
            handle.on_restore(hook.remove)
            handle.register_logits_hook(self._on_logits)
        except BaseException:
            handle.restore()
            raise
        self.handle = handle

    def check_layout(self, layout: ParallelLayout) -> None:
        """Raise `SetupError` with every plugin's refusal of `layout` (`aniso_refuse_layout`);
        changes nothing. `setup` calls it first; an adapter may call it earlier, to refuse a
        layout before anything of its own changes."""
        refusals = self.plugins.layout_refusals(layout)
        if refusals:
            raise SetupError("; ".join(refusals))

    def detach(self, keep_head: bool = False) -> None:
        """Undo everything set-up did to the model (installed forwards, hooks, head surgery):
        afterwards it has the same modules, Parameters, tying and forwards as before `setup`,
        and a new session (or this one, with `setup`) can attach to it again. `keep_head`
        keeps a replaced or untied head (trained: it is the run's result) and removes only
        the instrumentation. A no-op when not set up. Training state (counters) is kept until
        the session is discarded."""
        if self.handle is None:
            return
        self.handle.restore(keep_surgery=keep_head)
        self.handle = None
        self._head_computes_loss = False
        self.run = None
        self._current = None
        self._loss_due = False
        self._clear_micro_batch()
        self._eval = None

    @_in_world
    def begin_training(
        self,
        *,
        epoch_steps: int | None = None,
        start_step: int = 0,
        accumulation_steps: int = 1,
        loss_scale: float = 1.0,
        grad_scaler: GradScaler | None = None,
        label_smoothing: float = 0.0,
        engine_root: nn.Module | None = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> RunInfo:
        """Training starts or resumes; the plugins learn what the trainer knows.

        epoch_steps: optimizer steps per epoch (`epoch_length` computes it), None if unknown;
        start_step: optimizer steps already done; accumulation_steps: the trainer's micro-batches
            per step (times the layout's ``pipeline_micro_batches``: the session's);
        loss_scale: gradient weight of the loss terms, the factor by which the trainer weighs
            the model's loss beyond its mean over the step on the way to the backward (the HF
            Trainer's accumulation steps × processes on a model's own mean loss; Lightning's
            extra 1/accumulation under DeepSpeed), times the layout's ``gradient_weight`` (its
            data-parallel reduction);
        grad_scaler: the trainer's fp16 gradient scaler, if any: backward runs on the scaled
            loss, so the loss terms are scaled by its current scale too;
        label_smoothing: the trainer's label smoothing of the token loss (`RunInfo`);
        engine_root: the trainer's outermost wrapper of the model once wrapped, where its engine
            partitions parameters in units of its own (FSDP1: `ModelHandle.engine_root`);
        optimizers: the trainer's optimizers, built (`RunInfo.optimizers`).
        State loaded before this call is restored right after the plugins' hook."""
        if self.handle is None:
            raise SetupError("TrainingSession.setup(handle) must run before begin_training")
        accumulation_steps *= self.layout.pipeline_micro_batches
        self.run = RunInfo(epoch_steps, start_step, accumulation_steps, label_smoothing, tuple(optimizers))
        self._loss_scale = loss_scale * self.layout.gradient_weight
        self._grad_scaler = grad_scaler
        self.handle.engine_root = engine_root
        self.plugins.begin_training(self.run)
        if self._pending_state is not None:
            (state, where), self._pending_state = self._pending_state, None
            self._restore(state, where)
        return self.run

    @staticmethod
    def epoch_length(batches: object, accumulation_steps: int) -> int | None:
        """Optimizer steps per epoch of `batches` micro-batches (a count or sized loader), or None."""
        return optimizer_steps_per_epoch(batches, accumulation_steps)

    # --- training ---------------------------------------------------------------------------
    @_in_world
    def begin_step(self, batches: Sequence[MicroBatchTargets | torch.Tensor | None], *, step: int) -> None:
        """Announce optimizer step `step`'s training micro-batches on this rank, in order, before
        the first one's forward (only where `wants_step_targets`): each as `begin_micro_batch`
        takes it (None, or None targets: a label-free batch, which has no targets to count).
        The plugins see the whole step at once (`aniso_step_targets`), so what they read of
        "the batch" is the optimizer step's whole batch whatever the split into micro-batches
        (gradient accumulation) and ranks. Each micro-batch is then announced as usual."""
        if self.run is None:
            raise SetupError("TrainingSession.begin_training(...) must run before the first step")
        targets = []
        for batch in batches:
            batch = MicroBatchTargets(batch) if isinstance(batch, torch.Tensor) else batch
            if batch is not None and batch.targets is not None:
                targets.append(self._head_targets(batch.targets))
        info = StepInfo(step=step, accumulation_steps=max(len(batches), 1), batch_group=self._batch_group)
        self.plugins.step_targets(targets, info)

    @_in_world
    def begin_micro_batch(
        self,
        batch: MicroBatchTargets | torch.Tensor,
        *,
        step: int,
        accumulation_steps: int = 1,
        measure: bool = False,
        head_calls: int = 1,
        loss_normalizer: torch.Tensor | None = None,
        supplies_loss: bool = False,
    ) -> StepInfo:
        """Announce a training micro-batch: its targets, already aligned with the head's output
        (a tensor), or the targets with the token ids, padding mask and packed-example ids at
        the head's positions (`MicroBatchTargets`, as `micro_batch_targets` reads them).

        step: 1-based index of the optimizer step this micro-batch belongs to;
        accumulation_steps: the trainer's micro-batches in this step (a trainer's last window of
        an epoch may be shorter; times the layout's ``pipeline_micro_batches``); measure: whether metrics are measured after this step;
        head_calls / loss_normalizer: see `StepInfo`;
        supplies_loss: the batch has no labels and `supplied_loss()` will be its loss (only
        when `supplies_loss` says the configuration can)."""
        if isinstance(batch, torch.Tensor):
            batch = MicroBatchTargets(batch)
        if self.run is None:
            raise SetupError("TrainingSession.begin_training(...) must run before the first micro-batch")
        if self._current is not None and self._current.step != step:
            self._micro_batch = 0
        info = StepInfo(
            step=step,
            micro_batch=self._micro_batch,
            accumulation_steps=max(accumulation_steps * self.layout.pipeline_micro_batches, self._micro_batch + 1),
            measure=measure,
            head_calls=head_calls,
            loss_normalizer=loss_normalizer,
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            sequence_ids=batch.sequence_ids,
            batch_group=self._batch_group,
        )
        if supplies_loss and not self.supplies_loss:
            raise ConfigError(
                f"a training batch without labels: method={self.config.method} has no loss of its own to train on "
                "(no plugin supplies one, as 'simcse' does); give the batches labels"
            )
        self._micro_batch += 1
        self._current = info
        self._clear_micro_batch()
        targets = self._head_targets(batch.targets)
        self.plugins.targets(targets, info)
        self._loss_due = self.config.reg_every_microbatch or info.last_micro_batch
        self._activations_due = self.plugins.implements("aniso_activation_loss_terms")
        self._targets = targets
        self._supplying = supplies_loss
        return info

    def _clear_micro_batch(self) -> None:
        self._activations_due = False
        self._targets = None
        self._head_input = None
        self._supplied = None
        self._supplying = False

    @_in_world
    def attach_activation_terms(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden`, the LM head's input for the whole current micro-batch, with this
        micro-batch's activation-dependent loss terms attached (same value; backward also
        sends their gradient). For adapters whose loss calls the head on chunks (torchtitan);
        elsewhere the head's forward hook does it. A no-op when none are due."""
        if not (self._activations_due and hidden.requires_grad and torch.is_grad_enabled()):
            return hidden
        self._activations_due = False
        total = self.plugins.activation_loss_terms(hidden, self._targets, self._current)
        return hidden if total is None else attach_loss(hidden, total, self._gradient_scale(hidden.device) * self._share_weight())

    def supplied_loss(self) -> torch.Tensor:
        """The loss of a micro-batch announced with ``supplies_loss=True``, after its forward:
        backward through it sends exactly the loss terms' gradients (as `attach_loss`), and its
        value is the micro-batch's term (the sum of the shares over ranks, on average over
        ranks). Its value may be rescaled for logging without changing the gradient."""
        loss, self._supplied = self._supplied, None
        if loss is None:
            raise SetupError(
                "TrainingSession.supplied_loss: no loss terms were computed in this micro-batch's forward (announce it "
                "with begin_micro_batch(..., supplies_loss=True) and run the model's forward first)"
            )
        return loss

    @_in_world
    def end_step(self, step: int) -> None:
        """The optimizer step `step` was applied (`SetupError` where due loss terms never ran)."""
        info = self._current
        if info is None or info.step != step:
            info = StepInfo(step=step, batch_group=self._batch_group)
        if self._loss_due and self.plugins.implements("aniso_loss_terms"):
            raise SetupError(self.plugins.unconsumed_terms(step))
        self.plugins.step_end(info)
        self._micro_batch = 0
        self._loss_due = False

    @property
    def _batch_group(self) -> dist.ProcessGroup | None:
        """The layout's batch group, or its world (`StepInfo.batch_group`)."""
        return self.layout.batch_group if self.layout.batch_group is not None else self.layout.world

    def _gradient_scale(self, device: torch.device) -> float | torch.Tensor:
        """Weight of a term identical on every rank (the weight loss terms): ``loss_scale``, times
        the fp16 loss scale where a scaler is on, as a tensor on `device` (`amp_scale`: no host read)."""
        scaler = self._grad_scaler
        if scaler is None or not scaler.is_enabled():
            return self._loss_scale
        return self._loss_scale * amp_scale(scaler, device)

    def _share_weight(self) -> float:
        """Weight of a rank's share relative to `_gradient_scale`, ``world / copies²``: the
        trainer's reduction of ``loss_scale``-weighted terms over the ``world / copies``
        data-parallel ranks makes the shares sum (DDP averages: 1 · world; torchtitan sums:
        1/dp · dp), and the ``copies`` ranks holding one micro-batch (TP, the layout's
        ``batch_copies``) sum the head input's gradient, so each adds 1/copies of it."""
        return rank_and_world()[1] / self.layout.batch_copies**2

    def _on_head_input(self, module: nn.Module, args):
        if self._activations_due and module.training and args and isinstance(args[0], torch.Tensor):
            if self._current is not None and self._current.head_calls > 1:
                raise SetupError(
                    "activation loss terms with a head called on chunks of the micro-batch: the adapter must call "
                    "TrainingSession.attach_activation_terms(hidden) on the whole micro-batch before its loss"
                )
            self._head_input = args[0]
        return None

    @_in_world
    def _on_logits(self, logits: torch.Tensor) -> None:
        """The logits the model's loss reads (`ModelHandle.register_logits_hook`): inside
        `evaluating`, the evaluation batch's."""
        if self._eval is not None and not self._eval_paused:
            targets = self._eval.take(logits.shape[:-1])
            if targets is not None:
                self.plugins.eval_batch(self._whole_vocabulary(logits.detach()), targets)

    def _whole_vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        """Evaluation logits over all V ids: a tensor-parallel rank's vocabulary shard of them
        (`ModelHandle.vocab_mesh`) all-gathered over the shards (collective: the ranks of a TP
        group evaluate the same chunks in step), one evaluation chunk at a time."""
        mesh = self.handle.vocab_mesh if self.handle is not None else None
        if mesh is None:
            return logits
        from torch.distributed.tensor import DTensor, Shard

        shape = (*logits.shape[:-1], self.handle.vocab_size)
        stride = tuple(torch.empty(shape, device="meta").stride())
        return DTensor.from_local(logits, mesh, [Shard(logits.dim() - 1)], run_check=False, shape=shape,
                                  stride=stride).full_tensor()

    @_in_world
    def _on_head_output(self, module: nn.Module, args, output: torch.Tensor):
        if self._eval is not None or not (module.training and torch.is_grad_enabled()):
            return None
        total = None
        hidden, self._head_input = self._head_input, None
        if hidden is not None and self._activations_due and hidden.requires_grad:
            self._activations_due = False
            shares = self.plugins.activation_loss_terms(hidden, self._targets, self._current)
            if shares is not None:
                total = shares * self._share_weight()
        if self._loss_due:
            self._loss_due = False
            terms = self.plugins.loss_terms(self._current)
            if terms is not None:
                total = terms if total is None else total + terms
        if total is None:
            return None
        if self._supplying:  # no token loss: the terms are this micro-batch's whole loss
            value = total.detach().requires_grad_()
            if rank_and_world()[1] > 1:  # DDP all-reduces only once every parameter of the forward has a
                value = value + zero_through(output)  # gradient: the head's get zeros (one backward through it)
            self._supplied = attach_loss(value, total, self._gradient_scale(output.device))
            return None
        return attach_loss(output, total, self._gradient_scale(output.device))

    # --- measurement ------------------------------------------------------------------------
    @_in_world
    def measure(self, step: int, kind: str = "train") -> dict[str, float]:
        """Metrics (``aniso/...``) at `step`; collective, identical on every rank. The head and the
        embedding are read whole (`ModelHandle.full_weights`: gathered where an engine partitions
        them between steps)."""
        info = StepInfo(step=step, measure=True, batch_group=self._batch_group)
        if self.handle is None:
            return self.plugins.measure(info, kind)
        with self.handle.full_weights():
            return self.plugins.measure(info, kind)

    def measure_and_log(
        self, step: int, kind: str = "train", sink: MetricsSink | None = None, prefix: str = ""
    ) -> dict[str, float]:
        """Measure (collective: every rank), hand the metrics, named ``prefix + "aniso/..."``,
        to `sink` (the trainer's own logger; skipped when there are none), then to the plugins'
        `aniso_log`, in that order. Returns them."""
        metrics = {prefix + name: value for name, value in self.measure(step, kind).items()}
        if metrics and sink is not None:
            sink(metrics)
        self.plugins.log(metrics, step, kind)
        return metrics

    def summary(self, logs: Mapping[str, object], prefix: str = "") -> dict[str, float]:
        """The plugins' summary values (`aniso_summary_metrics`) present in `logs` (names with
        `prefix` before ``aniso/``), short label -> value, in the plugins' order."""
        return {label: float(logs[prefix + name]) for label, name in self.plugins.summary_metrics().items()
                if isinstance(logs.get(prefix + name), (int, float))}

    @contextlib.contextmanager
    def evaluating(self, targets: torch.Tensor | None, head_calls: int = 1) -> Iterator[None]:
        """While inside, the logits the model's loss reads (`ModelHandle.register_logits_hook`:
        the head's outputs, or a transformers model's output logits after any logit bias or
        soft-cap) are evaluation logits for `targets` (aligned with them; the i-th of
        `head_calls` head calls gets the i-th equal chunk of the last dimension) and go to the
        plugins' `aniso_eval_batch`. Logits whose leading shape is not their chunk's (a
        generation step, (B, 1, V)) are not fed and leave the chunk for the next call. None
        targets: nothing is fed."""
        if targets is None or not self.wants_eval_batches:
            yield
            return
        self._eval = TargetChunks(self._head_targets(targets), head_calls)
        try:
            yield
        finally:
            self._eval = None

    def _head_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """The targets of the rows the head runs on: all of them, or, where the model compacts
        the head's input (`ModelHandle.head_skips_label`), those of the other labels, in order."""
        skip = self.handle.head_skips_label if self.handle is not None else None
        return targets if skip is None else targets[targets != skip]

    @contextlib.contextmanager
    def not_evaluating(self) -> Iterator[None]:
        """Inside `evaluating`, head outputs that are not the evaluation logits of its targets
        (the steps of ``generate()`` before the labelled forward, ``predict_with_generate``)."""
        paused, self._eval_paused = self._eval_paused, True
        try:
            yield
        finally:
            self._eval_paused = paused

    @_in_world
    def end_training(self, output_dir: str | os.PathLike, main_process: bool) -> None:
        """The trainer's training has ended: `aniso_end_training` (e.g. ``report_at_end``'s
        report into ``output_dir``, written by the `main_process` only). Every rank calls it: the
        head and the embedding are gathered for it (`ModelHandle.full_weights`)."""
        if self.handle is None:
            self.plugins.end_training(os.fspath(output_dir), main_process)
            return
        with self.handle.full_weights():
            self.plugins.end_training(os.fspath(output_dir), main_process)

    # --- state ------------------------------------------------------------------------------
    STATE_FILE = "aniso_state.safetensors"

    @_in_world
    def state_dict(self) -> dict:
        """In-memory state for trainers that checkpoint Python objects (Lightning):
        ``{"config": dict, "plugins": {namespace: {key: tensor}}}``."""
        return {"config": self.config.to_dict(), "plugins": self.plugins.state_dict()}

    @_in_world
    def load_state_dict(self, state: dict, where: str = "checkpointed aniso_plugins state") -> None:
        """Restore `state_dict()` output, refusing one from an incompatible configuration
        (see `load` for what a refusal does). Before `begin_training` it is kept and restored
        when training begins. `where` names the state's origin in messages."""
        with self.reading_state(where):
            if not isinstance(state, Mapping) or not {"config", "plugins"} <= set(state):
                raise StateError(f"{where}: not an aniso_plugins state (expected the keys 'config' and 'plugins')")
            check_compatible(state["config"], self.config.to_dict(), where)
            self._restore(state["plugins"], where)

    @_in_world
    def save(self, directory: str | os.PathLike) -> str:
        """Write the plugins' state into `directory` (call on one rank); returns the path."""
        path = os.path.join(os.fspath(directory), self.STATE_FILE)
        remove_stale_temporaries(path)
        self.plugins.save(path)
        return path

    @_in_world
    def load(self, directory: str | os.PathLike) -> bool:
        """Restore from `directory` if it holds a state file; returns whether it did.

        State that cannot be used (an unreadable file, another configuration, a counter window
        that cannot be re-cut exactly) raises `StateError` naming the file and the way out, or,
        with ``config.on_state_mismatch="reset"``, is skipped with a warning (fresh state)."""
        path = os.path.join(os.fspath(directory), self.STATE_FILE)
        remove_stale_temporaries(path)
        if not os.path.exists(path):
            return False
        with self.reading_state(path):
            self._restore(load_state(path, self.config.to_dict()), path)
        return True

    def _restore(self, plugin_state: Mapping[str, Mapping[str, torch.Tensor]], where: str) -> None:
        if self.run is None:
            self._pending_state = (plugin_state, where)
            return
        with self.reading_state(where):
            self.plugins.load_state_dict(plugin_state)

    @contextlib.contextmanager
    def reading_state(self, where: str) -> Iterator[None]:
        """Around reading and restoring saved state from `where` (a path, a checkpoint entry):
        any failure becomes a `StateError` that names `where`, what is wrong and the way out;
        with ``config.on_state_mismatch="reset"`` it is a warning instead and the plugins'
        state stays fresh."""
        try:
            try:
                yield
            except StateError:
                raise
            except Exception as e:  # unreadable bytes, or a plugin refusing its part
                raise StateError(f"{where}: the saved state cannot be used ({type(e).__name__}: {e}); {RESET_HINT}") from e
        except StateError as e:
            if self.config.on_state_mismatch != "reset":
                raise
            logger.warning("%s -- on_state_mismatch='reset': the plugins' state starts fresh", e)


__all__ = ["GradScaler", "MetricsSink", "TrainingSession"]
