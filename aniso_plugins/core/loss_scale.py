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

    def scale_tensor(self, device: torch.device | str) -> torch.Tensor:
        """The scale as a 0-dim tensor on `device` (the engine's): no host read."""
        probe = torch.ones((), device=device, requires_grad=True).clone()  # a loss to DeepSpeed: one element with a grad_fn
        optimizer = self._engine.optimizer
        if hasattr(optimizer, "scale_if_loss"):  # a ZeRO optimizer
            return optimizer.scale_if_loss(probe).detach()
        scaler = getattr(self._engine, "torch_autocast_z0_gradscaler", None)
        return scaler.scale(probe).detach() if scaler is not None else probe.detach()

    def get_scale(self) -> float:
        return float(self.scale_tensor(self._engine.device))


def amp_scale(scaler: GradScaler, device: torch.device | str) -> torch.Tensor | float:
    """What `scaler` multiplies the loss by, without a host read where it can: its
    ``scale_tensor(device)`` (`DeepSpeedLossScale`), or a ``torch.amp.GradScaler``'s scale tensor
    (``_get_scale_async()``, on its device); before its first ``scale()`` (no tensor yet) or for
    another scaler, ``get_scale()``, a float (``torch.amp.GradScaler``: its initial scale, no read)."""
    tensor = getattr(scaler, "scale_tensor", None)
    if callable(tensor):
        return tensor(device)
    held = getattr(scaler, "_get_scale_async", None)
    scale = held() if callable(held) else None
    return scale.to(device) if scale is not None else float(scaler.get_scale())


__all__ = ["DeepSpeedLossScale", "GradScaler", "amp_scale"]
