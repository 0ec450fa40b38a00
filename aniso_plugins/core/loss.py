"""Loss terms from plugins, and how an adapter makes them reach the gradients.

Some trainers let a callback change the loss (Lightning by patching ``training_step``,
torchtitan's loss); the HF Trainer does not, and clips gradients before any callback sees
them. `attach_loss` covers every case the same way: it returns ``output`` unchanged and,
in backward, sends ``scale`` as the gradient of the scalar ``loss`` — as if ``scale * loss``
had been added to whatever loss ``output`` flows into, whatever that loss's own scaling
(mean over tokens, division by accumulation steps) is. The adapter picks the one
micro-batch per optimizer step and the `scale` that its data-parallel reduction needs
(1 when gradients are averaged over ranks and every rank adds the same term; 1/world when
they are summed), times the fp16 AMP loss scale when a gradient scaler is active (the
scaler unscales every gradient before clipping)."""

from __future__ import annotations

import torch


class _AttachLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
        ctx.scale = scale.detach() if isinstance(scale, torch.Tensor) else scale
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        shape, dtype, device = ctx.loss_meta
        scale = torch.as_tensor(ctx.scale, dtype=dtype, device=device)  # a device tensor stays there: no host read
        return grad_output, scale.expand(shape).clone(), None


def attach_loss(output: torch.Tensor, loss: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Return `output` (same value) such that backward through it also backpropagates
    ``scale * loss``. `loss` is a differentiable scalar; `output` must reach the loss; `scale` a
    number or a 0-dim tensor on the loss's device (an fp16 loss scale, read without a host read).
    A tensor subclass `output` comes back as its class, with its attributes."""
    if loss.dim() != 0:
        raise ValueError(f"attach_loss: loss must be a scalar, got shape {tuple(loss.shape)}")
    if not loss.requires_grad:
        return output
    attached = _AttachLoss.apply(output, loss, scale)
    if type(output) is not torch.Tensor and type(attached) is not type(output):  # a carrier of the head's outputs
        attached = attached.as_subclass(type(output))  # (the fused loss's) stays one, with its attributes
        attached.__dict__.update(output.__dict__)
    return attached


class _ZeroThrough(torch.autograd.Function):
    """0 as a function of `x`, whose backward sends zeros to `x` (the parameters behind `x` take
    part in the backward with zero gradients)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.meta = (x.shape, x.dtype, x.device)
        return torch.zeros((), dtype=torch.float32, device=x.device)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        shape, dtype, device = ctx.meta
        return torch.zeros(shape, dtype=dtype, device=device)


def zero_through(x: torch.Tensor) -> torch.Tensor:
    """A float32 0 that depends on `x`: backward sends zeros to `x`, so the parameters behind `x`
    take part in the backward (DDP all-reduces only once every parameter of the forward has a
    gradient)."""
    return _ZeroThrough.apply(x)


__all__ = ["attach_loss", "zero_through"]
