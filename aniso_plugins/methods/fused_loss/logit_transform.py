"""`LogitTransform`: the elementwise map a model applies to its LM head's logits before its loss,
which the fused loss applies chunk by chunk with the chain rule in the gradient.

    z' = c · tanh(s · z / c)     soft-cap c (Gemma 2 and 3: ``final_logit_softcapping``)
    z' = s · z                   a scale s without a cap (Cohere's ``logit_scale``, Granite's
                                 1 / ``logits_scaling``, Falcon-H1's ``lm_head_multiplier``)

dz'/dz = s · (1 − tanh²(s · z / c)), or s. The loss is the cross-entropy of z'; the logit
gradient handed to the GEMMs (dX = G W, dW = Gᵀ X, and AGG's row gates on dW) is
(softmax(z') − onehot) ⊙ dz'/dz."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitTransform:
    """z ↦ softcap · tanh(scale · z / softcap), or scale · z when `softcap` is None."""

    scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not math.isfinite(self.scale) or self.scale == 0:
            raise ValueError(f"LogitTransform(scale={self.scale!r}): expected a finite nonzero number")
        if self.softcap is not None and (
            isinstance(self.softcap, bool) or not isinstance(self.softcap, (int, float)) or not math.isfinite(self.softcap)
            or self.softcap <= 0
        ):
            raise ValueError(f"LogitTransform(softcap={self.softcap!r}): expected a finite number > 0, or None")

    @property
    def identity(self) -> bool:
        """Whether the map changes nothing (scale 1, no cap)."""
        return self.softcap is None and self.scale == 1.0

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """z' for `z` (out of place)."""
        if self.softcap is None:
            return z * self.scale
        return torch.tanh(z * (self.scale / self.softcap)) * self.softcap

    def apply_(self, z: torch.Tensor) -> torch.Tensor:
        """Replace `z` by z' in place (returns `z`)."""
        if self.softcap is None:
            return z.mul_(self.scale)
        return z.mul_(self.scale / self.softcap).tanh_().mul_(self.softcap)

    def derivative(self, transformed: torch.Tensor) -> torch.Tensor | None:
        """dz'/dz from z' itself (a new tensor): s·(1 − (z'/c)²), since z'/c = tanh(s·z/c); None
        when it is the constant `scale`."""
        if self.softcap is None:
            return None
        return torch.square(transformed * (1.0 / self.softcap)).neg_().add_(1.0).mul_(self.scale)

    def chain_(self, grad: torch.Tensor, derivative: torch.Tensor | None) -> torch.Tensor:
        """``grad ⊙ dz'/dz`` in place (`derivative` from `derivative`)."""
        return grad.mul_(self.scale) if derivative is None else grad.mul_(derivative)


__all__ = ["LogitTransform"]
