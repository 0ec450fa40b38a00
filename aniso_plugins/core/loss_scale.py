"""What the session reads of a loss scale (`GradScaler`), and loss scales read like one for
engines that scale the loss in their own ``backward``: DeepSpeed's (fp16), where the trainer has
no `torch.amp.GradScaler`."""

from __future__ import annotations

from typing import Protocol

import torch


class GradScaler(Protocol):
    """What the session reads of a mixed-precision gradient scaler (``torch.amp.GradScaler``)."""

    def is_enabled(self) -> bool: ...

    def get_scale(self) -> float: ...


class DeepSpeedLossScale:
    """What a DeepSpeed engine's ``backward`` multiplies the loss by (after any division by the
    accumulation steps), read as the session reads an fp16 `torch.amp.GradScaler`, at each step
    (fp16's loss scale is dynamic): its ZeRO optimizer's ``scale_if_loss`` (DeepSpeed's fp16 loss
    scale; 1 in bf16 and fp32), or without ZeRO the engine's torch-autocast scaler, as
    ``engine.backward`` does in DeepSpeed 0.19. Weighting the loss terms by it keeps their share
    of the gradient that DeepSpeed unscales before the optimizer step."""

    def __init__(self, engine: torch.nn.Module) -> None:
        self._engine = engine

    def is_enabled(self) -> bool:
        return True

    def get_scale(self) -> float:
        probe = torch.ones((), requires_grad=True).clone()  # a loss to DeepSpeed: one element with a grad_fn
        optimizer = self._engine.optimizer
        if hasattr(optimizer, "scale_if_loss"):  # a ZeRO optimizer
            return float(optimizer.scale_if_loss(probe))
        scaler = getattr(self._engine, "torch_autocast_z0_gradscaler", None)
        return float(scaler.scale(probe)) if scaler is not None else 1.0


__all__ = ["DeepSpeedLossScale", "GradScaler"]
