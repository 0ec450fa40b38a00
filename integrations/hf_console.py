"""The HF Trainer's printed log, one readable line per record: the Trainer's printer
(``ProgressCallback`` under tqdm, ``PrinterCallback`` otherwise) gets each record with its
``aniso/...`` values replaced by one ``aniso`` entry holding the plugins' summary values
(`TrainingSession.summary`) and how many more values the loggers got; TensorBoard, W&B,
``state.log_history`` and every other callback get the full record."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from transformers import Trainer
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from aniso_plugins import TrainingSession

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
    """Give `trainer`'s printer `condensed_record`s (an instance attribute on each printer);
    returns the undo."""
    patched = []
    for printer in trainer.callback_handler.callbacks:
        if isinstance(printer, (ProgressCallback, PrinterCallback)) and "on_log" not in printer.__dict__:
            original = printer.on_log

            def on_log(args, state, control, logs=None, _original=original, **kwargs):
                return _original(args, state, control, logs=None if logs is None else condensed_record(logs, session),
                                 **kwargs)

            printer.on_log = on_log
            patched.append(printer)

    def undo() -> None:
        for printer in patched:
            printer.__dict__.pop("on_log", None)

    return undo
