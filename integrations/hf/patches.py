"""Every change the HF adapter makes to objects it does not own, each with its undo: the
Trainer's methods wrapped on the instance (``training_step``, ``prediction_step``, ``train``,
``compute_loss``, ``get_batch_samples``, ``model_init``, ``label_smoother``; `wrap_trainer`), the model's ``generate``
during a prediction step under ``predict_with_generate`` (`generation_not_evaluated`), the
printer's ``on_log`` (`condense_printed_logs`), and the call-stack walk that finds the Trainer a
callback is constructed in (`constructing_trainer`). `AnisoTrainerMixin` overrides the same
methods in its class instead and needs none of them but the printer's."""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from torch import nn
from transformers import Trainer
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from aniso_plugins import TrainingSession

if TYPE_CHECKING:
    from aniso_plugins.integrations.hf.callback import AnisoCallback

WRAPPED = ("training_step", "prediction_step", "train", "compute_loss", "get_batch_samples")
"""Trainer methods the callback route wraps on the instance (and refuses to wrap twice)."""

Patches = dict[str, tuple[Callable, Callable | None]]
"""Trainer attribute -> (the wrapper set on the instance, the instance's own value before, or None
when the class's method was in force)."""


def constructing_trainer() -> Trainer | None:
    """The `Trainer` whose ``__init__`` is on the call stack (callbacks are not given it)."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


def wrap_trainer(trainer: Trainer, callback: AnisoCallback) -> Patches:
    """The callback route: `trainer`'s methods wrapped on the instance, each calling the
    callback's method that `AnisoTrainerMixin` calls from its class; returns them for `unwrap`."""
    training_step, prediction_step, train = trainer.training_step, trainer.prediction_step, trainer.train
    compute_loss, model_init, get_batch_samples = trainer.compute_loss, trainer.model_init, trainer.get_batch_samples

    def get_batch_samples_announced(epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = get_batch_samples(epoch_iterator, num_batches, device)
        callback.before_step(batch_samples)
        return batch_samples, num_items_in_batch

    def training_step_with_targets(model, inputs, num_items_in_batch=None):
        callback.before_training_step(inputs)
        return training_step(model, inputs, num_items_in_batch)

    def compute_loss_or_supplied(model, inputs, return_outputs=False, num_items_in_batch=None):
        if callback.supplying(model):
            return callback.supplied_loss(trainer, model, inputs, return_outputs, num_items_in_batch)
        return compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def prediction_step_with_targets(model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        with callback.predicting(trainer, inputs):
            return prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)

    def train_remembering_checkpoint(resume_from_checkpoint=None, *args, **kwargs):
        return train(callback.resume_checkpoint(trainer, resume_from_checkpoint), *args, **kwargs)

    patches: Patches = {
        "training_step": (training_step_with_targets, None),
        "prediction_step": (prediction_step_with_targets, None),
        "train": (train_remembering_checkpoint, None),
    }
    if callback.session.supplies_loss:
        patches["compute_loss"] = (compute_loss_or_supplied, None)
    if callback.session.wants_step_targets:  # the optimizer step's micro-batches, before the first forward
        patches["get_batch_samples"] = (get_batch_samples_announced, None)
    if model_init is not None:  # train() builds a new model: set up on it before its optimizer exists
        patches["model_init"] = (with_set_up(model_init, callback._set_up), model_init)
    for name, (wrapper, _) in patches.items():
        setattr(trainer, name, wrapper)
    return patches


def patch_label_smoother(trainer: Trainer, patches: Patches, make: Callable[[Callable], Callable]) -> None:
    """``trainer.label_smoother`` replaced by ``make(label_smoother)`` (once; recorded in `patches`)."""
    smoother = trainer.label_smoother
    if smoother is not None and "label_smoother" not in patches:
        patches["label_smoother"] = (make(smoother), smoother)
        trainer.label_smoother = patches["label_smoother"][0]


def unwrap(trainer: Trainer, patches: Patches) -> None:
    """Undo `wrap_trainer` and `patch_label_smoother`: each attribute still holding its wrapper
    gets the class's method (or the instance's own value) back."""
    for name, (wrapper, original) in patches.items():
        if trainer.__dict__.get(name) is wrapper:
            if original is None:
                del trainer.__dict__[name]  # the class's method again
            else:
                trainer.__dict__[name] = original  # an attribute of the instance (model_init)


def with_set_up(model_init: Callable, set_up: Callable[[nn.Module], None]) -> Callable:
    """`model_init` (0 or 1 argument, as ``Trainer.call_model_init`` counts them) followed by
    `set_up` on the model it returns."""
    if len(inspect.signature(model_init).parameters) == 0:

        def fresh_model():
            model = model_init()
            set_up(model)
            return model

        return fresh_model

    def fresh_model_for(trial):
        model = model_init(trial)
        set_up(model)
        return model

    return fresh_model_for


@contextlib.contextmanager
def generation_not_evaluated(trainer: Trainer, session: TrainingSession) -> Iterator[None]:
    """Under ``predict_with_generate`` (`Seq2SeqTrainer`), the head outputs of
    ``trainer.model.generate`` are generation steps, not the evaluation logits of the
    labelled forward that follows: ``generate`` runs under `TrainingSession.not_evaluating`."""
    model = trainer.model
    if not getattr(trainer.args, "predict_with_generate", False) or not callable(getattr(model, "generate", None)):
        yield
        return
    own = model.__dict__.get("generate")
    generate = model.generate

    def generate_unseen(*args, **kwargs):
        with session.not_evaluating():
            return generate(*args, **kwargs)

    model.__dict__["generate"] = generate_unseen
    try:
        yield
    finally:
        if own is None:
            model.__dict__.pop("generate", None)
        else:
            model.__dict__["generate"] = own


_PREFIXES = ("aniso/", "eval_aniso/", "test_aniso/")


def condensed_record(logs: Mapping[str, object], session: TrainingSession) -> dict[str, object]:
    """`logs` without its ``aniso/...`` values, and with ``aniso``: ``"I(W) 0.61 · cos 0.12
    (+31 values in the loggers)"`` (the summary of whichever prefix the record holds)."""
    ours = [k for k in logs if k.startswith(_PREFIXES)]
    if not ours:
        return dict(logs)
    prefix = ours[0][: ours[0].index("aniso/")]
    summary = session.summary(logs, prefix)
    shown = " · ".join(f"{label} {value:.4g}" for label, value in summary.items())
    rest = len(ours) - len(summary)
    more = f"+{rest} values in the loggers" if rest else ""
    out = {k: v for k, v in logs.items() if k not in ours}
    out[prefix + "aniso"] = f"{shown} ({more})" if shown and more else shown or more
    return out


def condense_printed_logs(trainer: Trainer, session: TrainingSession) -> Callable[[], None]:
    """The HF Trainer's printed log, one readable line per record: `trainer`'s printer
    (``ProgressCallback`` under tqdm, ``PrinterCallback`` otherwise) gets `condensed_record`s (an
    instance attribute on each printer), while TensorBoard, W&B, ``state.log_history`` and every
    other callback get the full record; returns the undo."""
    patched = []
    for printer in trainer.callback_handler.callbacks:
        if isinstance(printer, (ProgressCallback, PrinterCallback)) and "on_log" not in printer.__dict__:
            original = printer.on_log

            def on_log(args, state, control, logs=None, _original=original, **kwargs: Any):
                return _original(args, state, control, logs=None if logs is None else condensed_record(logs, session),
                                 **kwargs)

            printer.on_log = on_log
            patched.append(printer)

    def undo() -> None:
        for printer in patched:
            printer.__dict__.pop("on_log", None)

    return undo


__all__ = [
    "WRAPPED", "Patches", "condense_printed_logs", "condensed_record", "constructing_trainer", "generation_not_evaluated",
    "patch_label_smoother", "unwrap", "with_set_up", "wrap_trainer",
]
