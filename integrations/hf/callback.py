"""`AnisoCallback`: the HF adapter's events (the package docstring, `aniso_plugins.integrations.hf`, says what it
does with the Trainer); its patches are `patches`, its layout `layout`, TRL's route `trl`."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel, Trainer, TrainerCallback
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.trainer_callback import DefaultFlowCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, IntervalStrategy

from aniso_plugins import AnisoConfig, OutputEmbeddingsHandle, SetupError, TargetRule, TrainingSession, alignment_of
from aniso_plugins import micro_batch_targets, target_rule
from aniso_plugins.models.causal_loss import FusedLabelSmoother, install_fused_causal_loss
from aniso_plugins.models.handle import peft_base_model
import aniso_plugins.integrations.hf.layout as layout
import aniso_plugins.integrations.hf.liger as liger
import aniso_plugins.integrations.hf.patches as patches
import aniso_plugins.integrations.hf.trl as trl
from aniso_plugins.integrations.hf.checkpoints import newest_complete_checkpoint
from aniso_plugins.integrations.hf.layout import loss_scaler, model_loss_scale

logger = logging.getLogger("aniso_plugins.hf")

_EVAL_PREFIX = "eval_"


def hf_handle(model: nn.Module, head: str | None = None) -> OutputEmbeddingsHandle:
    """The `ModelHandle` of a transformers model (a PEFT ``PeftModel``: of its base model), its
    LM head the module that makes the logits (`aniso_plugins.models.handle.output_projection`) or
    the submodule at `head`; a clear error for anything else."""
    base = peft_base_model(model)
    if not isinstance(base, PreTrainedModel):
        raise SetupError(f"AnisoCallback needs a transformers PreTrainedModel (or a PEFT model of one), got {type(model).__name__}")
    return OutputEmbeddingsHandle(model, head=head)


class AnisoCallback(TrainerCallback):
    """Runs aniso_plugins methods and metrics inside a `transformers.Trainer`.

    config: the `AnisoConfig` (default: geometry metrics only, training unchanged).
    plugins: extra plugin objects (third-party plugins also load from entry points).
    targets: how a batch's targets align with the LM head's outputs: None (as the model's own
        loss aligns its ``labels``), "causal", "aligned", "seq2seq"
        (`aniso_plugins.core.targets.ALIGNMENTS`), or a function of the batch returning the ids
        aligned with the head's output positions (``config.ignore_index`` where none).
    head: path of the LM head in the model (a PEFT model: in its base model), where the module
        that makes the logits is not the one found (`aniso_plugins.models.handle.output_projection`:
        ``get_output_embeddings()`` when it projects onto the vocabulary, else the one module
        that does).
    """

    def __init__(
        self,
        config: AnisoConfig | None = None,
        plugins: Iterable[object] = (),
        *,
        targets: Callable[[Any], torch.Tensor] | str | None = None,
        head: str | None = None,
    ) -> None:
        self._plugins = tuple(plugins)
        self._head = head
        self.session = TrainingSession(config, self._plugins)
        self.config = self.session.config
        self._targets = targets
        self._rule: TargetRule | None = None
        self.trainer: Trainer | None = None
        self._pending: dict[str, float] = {}
        self._resume_dir: str | None = None
        self._measure_next = False
        self._supplying = False
        self._patches: patches.Patches = {}
        self._owned = False  # built by AnisoTrainerMixin: its class methods do what patches.wrap_trainer does
        self._trl_unroute: Callable[[], None] | None = None  # removes trl.route_through_head's hooks
        self._labels_at_fused_call = False  # TRL's DPO, GRPO, ...: micro-batches announced at the fused call
        self._console_undo: Callable[[], None] = lambda: None  # gives the Trainer's printer its on_log back

    # --- wiring -----------------------------------------------------------------------------
    def attach(self, trainer: Trainer) -> AnisoCallback:
        """Wire this callback into `trainer` (done automatically when the callback is passed
        to ``Trainer(callbacks=[...])``). Call before ``train()``; returns self. Transactional:
        if it raises, the model and the Trainer are as they were."""
        if self.trainer is trainer:
            return self
        self._check(trainer)
        self.trainer = trainer
        handler = trainer.callback_handler
        if self not in handler.callbacks:
            handler.add_callback(self)
        handler.callbacks.remove(self)
        flow = [i for i, cb in enumerate(handler.callbacks) if isinstance(cb, DefaultFlowCallback)]
        handler.callbacks.insert(flow[-1] + 1 if flow else 0, self)
        try:
            if not self._owned:
                self._patches = patches.wrap_trainer(trainer, self)
            self._console_undo = patches.condense_printed_logs(trainer, self.session)
            if self.session.handle is None:
                self._set_up(trainer.model)
        except BaseException:
            self.detach()  # nothing stays half-applied: the model and the Trainer as they were
            raise
        return self

    def _check(self, trainer: Trainer) -> None:
        """Everything `attach` refuses, checked before anything is changed."""
        if self.trainer is not None:
            raise SetupError("this AnisoCallback is already attached to another Trainer: detach() it first, or make a new one")
        others = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, AnisoCallback) and cb is not self]
        if others:
            raise SetupError(
                "this Trainer has two AnisoCallbacks: use one AnisoCallback per Trainer, with all methods and metrics "
                "in its AnisoConfig (method=('agg', 'simctg'), metrics=(...))"
            )
        wrapped = [name for name in patches.WRAPPED if name in trainer.__dict__]
        if wrapped:
            raise SetupError(
                f"this Trainer's {', '.join(wrapped)} are already replaced on the instance (another AnisoCallback, "
                "or your own patch): use one AnisoCallback per Trainer, with all options in its AnisoConfig"
            )
        old_trl = trl.unsupported_version(trainer)
        if old_trl is not None:
            raise SetupError(old_trl)
        self.session.check_layout(layout.layout_of(trainer))  # refused before any callback's set-up
        if self.session.handle is None:
            model = hf_handle(trainer.model, self._head).model
            target_rule(self._targets, lambda: alignment_of(model))

    def _set_up(self, model: nn.Module) -> None:
        """Set the session up on `model` (a new model of ``model_init``: after undoing the
        previous model's set-up, with fresh plugin state)."""
        handle = hf_handle(model, self._head)
        rule = target_rule(self._targets, lambda: alignment_of(handle.model))
        if self.session.handle is not None:
            self.session.detach()
            self.session = TrainingSession(self.config, self._plugins)
        why_not = _why_loss_is_not_reproduced(self.trainer, handle, self.config)
        run_layout = layout.layout_of(self.trainer)
        if self.session.uses_head_forward:  # Liger's fused linear cross-entropy set aside for ours
            handle.on_restore(liger.answer(self.trainer, handle.model))
            if why_not is not None and run_layout.chunked_loss and run_layout.token_outputs is None and self.config.fused_loss is not False:
                handle.restore()
                raise SetupError(
                    f"{run_layout.chunked_loss} never holds the logits; aniso_plugins' fused loss would answer it with "
                    f"the methods applied, but not for this model: {why_not}. Set liger_kernel_config="
                    "{'fused_linear_cross_entropy': False} (or AnisoConfig(fused_loss=False): the logits in memory), "
                    "or train without Liger's fused linear cross-entropy"
                )
        self.session.setup(handle, run_layout, owns_loss=why_not is None, why_not=why_not or "")
        self._unroute_trl()
        self._labels_at_fused_call = trl.labels_at_fused_call(self.trainer)
        if self._labels_at_fused_call:  # TRL's DPO, GRPO, ...: each micro-batch announced at the policy's fused call
            self._trl_unroute = trl.announce_fused_calls(model, self._announce)
        elif trl.is_trl_trainer(self.trainer):  # TRL's SFTTrainer: its fused LM head through the model's head
            self._trl_unroute = trl.route_through_head(model, self.trainer, self.session, layout.head_transform(handle),
                                                       handle.head)
        elif self.session.head_computes_loss:  # the model's loss function and the label smoother take the head's sum
            transform = layout.head_transform(handle)
            handle.on_restore(install_fused_causal_loss(handle.model, self.config.ignore_index, transform))
            patches.patch_label_smoother(self.trainer, self._patches, lambda smoother: FusedLabelSmoother(smoother, transform))
        self._rule = rule

    def _unroute_trl(self) -> None:
        if self._trl_unroute is not None:
            self._trl_unroute()
            self._trl_unroute = None

    def detach(self, keep_head: bool = False) -> None:
        """Undo what this callback did: the model gets back its forwards, hooks, head and tying
        exactly as before (`keep_head=True` keeps a replaced or untied head, whose trained
        Parameters are the run's result), the Trainer its own ``training_step``,
        ``prediction_step``, ``train`` and ``model_init``, and the callback leaves its
        callback list. A new ``AnisoCallback`` can then attach to the same model (e.g. a
        notebook cell run again)."""
        self._unroute_trl()
        self.session.detach(keep_head=keep_head)
        trainer, self.trainer = self.trainer, None
        if trainer is None:
            return
        self._console_undo()
        patches.unwrap(trainer, self._patches)
        self._patches = {}
        if self in trainer.callback_handler.callbacks:
            trainer.callback_handler.callbacks.remove(self)

    # --- what both routes call (patches.wrap_trainer's wrappers, AnisoTrainerMixin's overrides) -----
    def supplying(self, model: nn.Module) -> bool:
        """Whether this training micro-batch trains on the plugins' supplied loss (label-free)."""
        return model.training and self._supplying

    def supplied_loss(self, trainer: Trainer, model: nn.Module, inputs, return_outputs=False, num_items_in_batch=None):
        """`Trainer.compute_loss` for a label-free batch: the forward, then the session's
        supplied loss (logged as the step's term)."""
        outputs = model(**inputs)
        loss = self.session.supplied_loss()
        if _trainer_divides_by_accumulation(trainer, num_items_in_batch):
            loss = loss * trainer.current_gradient_accumulation_steps
        return (loss, outputs) if return_outputs else loss

    @contextlib.contextmanager
    def predicting(self, trainer: Trainer, inputs: dict[str, Any]) -> Iterator[None]:
        """Around ``Trainer.prediction_step``: its logits are evaluation logits for the batch's
        targets (not those of ``generate()`` under ``predict_with_generate``)."""
        targets = self._rule.read(inputs, self.config.ignore_index).targets if self._rule is not None else None
        with self.session.evaluating(targets), patches.generation_not_evaluated(trainer, self.session):
            yield

    def resume_checkpoint(self, trainer: Trainer, resume_from_checkpoint: str | bool | None) -> str | None:
        """The checkpoint ``train(resume_from_checkpoint=...)`` resumes from (True: the newest
        complete one), remembered to restore the plugins' state from it."""
        ckpt = resume_from_checkpoint
        if isinstance(ckpt, bool):
            ckpt = newest_complete_checkpoint(trainer.args.output_dir) if ckpt else None
        self._resume_dir = ckpt
        return ckpt

    def before_step(self, batch_samples: list[Any]) -> None:
        """The Trainer fetched an optimizer step's micro-batches (``get_batch_samples``, before the
        first forward): announce them all where a plugin reads the step's whole batch."""
        if not self.session.wants_step_targets or self._rule is None:
            return
        reads = [self._rule.read(inputs, self.config.ignore_index) for inputs in batch_samples]
        self.session.begin_step(reads, step=self.trainer.state.global_step + 1)

    def before_training_step(self, inputs: dict[str, Any]) -> None:
        """A training micro-batch is about to run: announce its targets to the session (for TRL's
        trainers whose loss builds the labels, at the policy's fused call instead: `_announce`)."""
        if not self._labels_at_fused_call:
            self._announce(inputs)

    def _announce(self, inputs: dict[str, Any]) -> None:
        read = self._rule.read(inputs, self.config.ignore_index)
        input_ids = inputs.get("input_ids")
        self._supplying = read.targets is None and self.session.supplies_loss and input_ids is not None
        if self._supplying:  # SimCSE without MLM labels: no position has a token loss
            read = micro_batch_targets(inputs, torch.full_like(input_ids, self.config.ignore_index))
        if read.targets is None:
            raise SetupError(
                "AnisoCallback: a training batch has no 'labels' (or 'shift_labels'); the targets are needed "
                "(use DataCollatorForLanguageModeling, or add labels; label-free batches train only with "
                "method='simcse' and SimCSECollator)"
            )
        trainer = self.trainer
        self.session.begin_micro_batch(
            read,
            step=trainer.state.global_step + 1,
            accumulation_steps=getattr(trainer, "current_gradient_accumulation_steps", trainer.args.gradient_accumulation_steps),
            measure=self._measure_next,
            supplies_loss=self._supplying,
        )

    # --- trainer events ---------------------------------------------------------------------
    def on_init_end(self, args, state, control, model=None, **kwargs):
        if self._owned:
            return  # AnisoTrainerMixin attaches it once Trainer.__init__ has succeeded
        trainer = patches.constructing_trainer()
        if trainer is None:
            logger.warning("AnisoCallback could not find the Trainer being constructed; call callback.attach(trainer) "
                           "before train()")
            return
        self._check(trainer)  # refused before any callback's set-up changed the model
        # set up after every other callback's on_init_end (the handler's loop reaches appended ones)
        trainer.callback_handler.callbacks.append(_AttachAfterInit(self, trainer))

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        if self.trainer is None:
            raise SetupError(
                "AnisoCallback was not attached: pass it as Trainer(callbacks=[...]) or call callback.attach(trainer) "
                "before train()"
            )
        self.session.begin_training(
            epoch_steps=self.session.epoch_length(train_dataloader, args.gradient_accumulation_steps),
            start_step=state.global_step,
            accumulation_steps=args.gradient_accumulation_steps,
            grad_scaler=loss_scaler(self.trainer),
            label_smoothing=args.label_smoothing_factor if self.trainer.label_smoother is not None else 0.0,
            loss_scale=model_loss_scale(self.trainer, self.session.handle, self.session.supplies_loss),
            engine_root=self.trainer.model_wrapped,
            optimizers=() if kwargs.get("optimizer") is None else (kwargs["optimizer"],),
        )
        if state.global_step > 0:
            directory = self._resume_dir or os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            if self.session.load(directory):
                logger.info("aniso_plugins state restored from %s", directory)
            else:
                logger.warning(
                    "resuming at step %d without aniso_plugins state (no %s in %s): counters start empty",
                    state.global_step,
                    TrainingSession.STATE_FILE,
                    directory,
                )
        self._measure_next = self._will_log(args, state, state.global_step + 1)

    def _will_log(self, args, state, step: int) -> bool:
        """Whether the Trainer will log at the end of `step` (DefaultFlowCallback's rule)."""
        logs = (args.logging_strategy == IntervalStrategy.STEPS and state.logging_steps and step % state.logging_steps == 0) or (
            args.logging_first_step and step == 1
        )
        return self.session.measures_at(step, bool(logs))

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        self.session.end_step(step)
        if control.should_save:  # before the Trainer's own save, which may rotate the previous checkpoint away
            self._save_state(args, state)
        if self.session.measures_at(step, control.should_log):
            # into the Trainer's own record of this step (merged in on_log), or, at a step the
            # Trainer does not log (metrics_every), a record of its own
            sink = self._pending.update if control.should_log else (lambda m: self.trainer.log(dict(m)))
            self.session.measure_and_log(step, "train", sink)
        self._measure_next = self._will_log(args, state, step + 1)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        def add_to_record(extra: dict[str, float]) -> None:
            logs.update(extra)
            if state.log_history:
                state.log_history[-1].update(extra)

        if any(k.startswith(_EVAL_PREFIX) for k in logs):
            self.session.measure_and_log(state.global_step, "eval", add_to_record, prefix=_EVAL_PREFIX)
        elif "loss" in logs and self._pending:
            extra, self._pending = self._pending, {}
            add_to_record(extra)

    def on_train_end(self, args, state, control, **kwargs):
        self.session.end_training(args.output_dir, main_process=state.is_world_process_zero)

    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_save:
            self._save_state(args, state)

    def on_save(self, args, state, control, **kwargs):
        # saves decided after evaluation (save_strategy="best") were not known at on_step_end
        if not os.path.exists(os.path.join(self._checkpoint_dir(args, state), TrainingSession.STATE_FILE)):
            self._save_state(args, state)

    def _checkpoint_dir(self, args, state) -> str:
        return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")

    def _save_state(self, args, state) -> None:
        """The plugin state into this step's checkpoint folder, atomically, on the saving process.
        Written before the Trainer saves and rotates checkpoints, so that a kill at any instant
        leaves the newest complete checkpoint with its own state (`newest_complete_checkpoint`
        skips a folder whose save was interrupted)."""
        if args.should_save:
            directory = self._checkpoint_dir(args, state)
            os.makedirs(directory, exist_ok=True)
            self.session.save(directory)


class _AttachAfterInit(TrainerCallback):
    """Appended by `AnisoCallback.on_init_end` to run last in the same ``on_init_end`` pass:
    attaches the callback once every other callback's ``on_init_end`` has succeeded, then
    leaves the list."""

    def __init__(self, callback: AnisoCallback, trainer: Trainer) -> None:
        self.callback, self.trainer = callback, trainer

    def on_init_end(self, args, state, control, **kwargs):
        self.trainer.callback_handler.callbacks.remove(self)
        self.callback.attach(self.trainer)


def _why_loss_is_not_reproduced(trainer: Trainer, handle: OutputEmbeddingsHandle, config: AnisoConfig) -> str | None:
    """None if the fused loss reproduces `trainer`'s training loss of the handle's model exactly
    (``Trainer.compute_loss`` of a conventional causal LM, `layout.fused_loss_refusal`), else why not."""
    if trainer.compute_loss_func is not None:
        return "the Trainer has a compute_loss_func, which computes the loss from the logits"
    if trl.token_outputs(trainer) is not None:  # SFTTrainer's loss from its chunked head: the head answers it
        return layout.fused_loss_refusal(trainer, handle, config.ignore_index)
    own = [c.__name__ for c in type(trainer).__mro__ if "compute_loss" in vars(c) and c is not Trainer
           and not c.__module__.startswith(__package__)]  # AnisoTrainerMixin's is the Trainer's
    if own:
        return f"{own[0]}.compute_loss replaces the Trainer's loss"
    name = handle.model._get_name()
    if trainer.label_smoother is not None and name not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        return f"label smoothing of {name}, which the Trainer does not shift as a causal LM"
    return layout.fused_loss_refusal(trainer, handle, config.ignore_index)  # sets handle.logit_transform


def _trainer_divides_by_accumulation(trainer: Trainer, num_items_in_batch) -> bool:
    """Whether ``Trainer.training_step`` divides the returned loss by the accumulation steps
    (its rule in transformers 5: unless the loss was normalized over the whole step)."""
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        scaled = (trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) or trainer.compute_loss_func is not None
    return not scaled


__all__ = ["AnisoCallback", "hf_handle"]
