"""Liger-Kernel beside aniso_plugins' methods (``pip install "aniso-plugins[liger]"``).

Liger's fused linear cross-entropy replaces the model's forward (``lce_forward``: the loss from
``lm_head.weight``, never the logits, never the head module), so a method acting in the head
would do nothing. Where one is on, the adapter answers it instead: Liger's other kernels (RMSNorm,
RoPE, SwiGLU, ...) stay, and the model's own forward runs, whose head computes the loss chunk by
chunk with aniso_plugins' fused loss (`aniso_plugins.fused_linear_cross_entropy`: the same
memory floor, the methods applied):

- ``TrainingArguments(use_liger_kernel=True)`` (applied by ``Trainer.train()``): its
  ``liger_kernel_config`` gets ``fused_linear_cross_entropy=False`` for the run (TRL's
  SFTTrainer does the same for its own fused head);
- ``apply_liger_kernel_to_<model>(model=model, ...)`` applied by hand (an instance forward of
  Liger's): that forward is set aside for the run (the class's forward runs).

Both are undone by ``detach()``. A class-wide patch (``apply_liger_kernel_to_<model>()`` without
``model=``) cannot be answered (the model class's own forward is gone) and is refused at set-up
(`aniso_plugins.models.head_bypass`). Where the fused loss cannot reproduce the model's loss, a
run that asked for Liger's fused loss is refused naming the setting."""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn

from aniso_plugins.models.handle import peft_base_model

logger = logging.getLogger("aniso_plugins.hf")

_FLCE = "fused_linear_cross_entropy"


def requested(trainer) -> bool:
    """Whether ``train()`` will apply Liger's fused linear cross-entropy (``use_liger_kernel=True``
    with its default or explicit ``fused_linear_cross_entropy=True``; TRL's SFTTrainer turns it off)."""
    if not getattr(trainer.args, "use_liger_kernel", False):
        return False
    return bool((getattr(trainer.args, "liger_kernel_config", None) or {}).get(_FLCE, True))


def patched_instance(model: nn.Module | None) -> bool:
    """Whether `model` (a PEFT model: its base model; None before ``model_init``) carries an
    instance forward of Liger's (``apply_liger_kernel_to_*(model=...)``)."""
    if model is None:
        return False
    forward = peft_base_model(model).__dict__.get("forward")
    function = getattr(forward, "__func__", forward)
    return function is not None and getattr(function, "__module__", "").startswith("liger_kernel")


def chunked_loss(trainer, model: nn.Module | None) -> str | None:
    """`ParallelLayout.chunked_loss` where Liger's fused linear cross-entropy trains `model`, else None."""
    if requested(trainer):
        return "Liger-Kernel's fused linear cross-entropy (TrainingArguments(use_liger_kernel=True))"
    if patched_instance(model):
        return "Liger-Kernel's fused linear cross-entropy (apply_liger_kernel_to_*(model=...))"
    return None


def answer(trainer, model: nn.Module) -> Callable[[], None]:
    """Set Liger's fused linear cross-entropy aside for this run (module docstring); returns the
    function that puts it back."""
    undo: list[Callable[[], None]] = []
    if requested(trainer):
        config = getattr(trainer.args, "liger_kernel_config", None)
        trainer.args.liger_kernel_config = {**(config or {}), _FLCE: False}
        undo.append(lambda: setattr(trainer.args, "liger_kernel_config", config))
    if patched_instance(model):
        forward = model.__dict__.pop("forward")
        undo.append(lambda: model.__dict__.__setitem__("forward", forward))
    if undo:
        logger.info("Liger-Kernel's fused linear cross-entropy is answered by aniso_plugins' fused loss through the "
                    "LM head (Liger's other kernels stay)")

    def restore() -> None:
        for step in reversed(undo):
            step()

    return restore


__all__ = ["answer", "chunked_loss", "patched_instance", "requested"]
