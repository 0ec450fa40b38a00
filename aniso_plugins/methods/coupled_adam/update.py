"""Coupled Adam (Stollenwerk & Stollenwerk, ACL 2025, arXiv 2502.08441; official code
``flxst/coupled-adam``, ``nanoGPT/coupled_adam.py``), docs/methods.md §17.

The softmax gradients of the output embedding E (V × H) sum to zero over the vocabulary, so SGD
leaves the mean embedding μ in place; Adam divides each element by its own √v̂, which grows with
the token's frequency, so the updates stop cancelling and μ drifts (anisotropy). Coupled Adam
shares the second moment over the vocabulary, per hidden dimension:

    m ← β1·m + (1 − β1)·G,    v ← β2·v + (1 − β2)·G²                  (per element, as AdamW)
    v̄[h] = s · (1/V) Σ_i v[i, h]                                       (s = 1 in the paper)
    E ← E − lr · (m / (1 − β1^t)) / (√(v̄ / (1 − β2^t)) + ε)             (v̄ broadcast over rows)

with AdamW's decoupled weight decay E ← (1 − lr·λ)·E first where enabled (the paper leaves the
embedding undecayed), and lr, β1, β2, ε, λ those of the trainer's optimizer group holding E.

`CoupledAdam` changes a trainer's own `torch.optim.Adam` / `AdamW` through its step hooks,
never by replacing it (the trainer's scheduler, checkpoints and wrappers keep the object they
hold): before each step it takes E out of its group, so Adam updates every other parameter as
before; after it, it updates E as above and puts it back. E's state keeps Adam's names
(``step``, ``exp_avg``, ``exp_avg_sq``) in ``optimizer.state``, so the trainer's checkpoint
saves and resumes it. Sharded rows (FSDP2, HSDP, torchtitan's vocabulary shards: DTensors) are
updated on each rank's shard, v̄ summed over the shards (`row_mean`).

No host read: the step count and the bias corrections stay on E's device; a fused optimizer's
``grad_scale`` / ``found_inf`` (fp16 loss scaling with ``fused=True``) are honoured on the
device as Adam's fused kernel does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aniso_plugins.core.errors import ConfigError
from aniso_plugins.numerics.rows import local_part, row_mean


def coupled_adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    *,
    lr: float | torch.Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float = 0.0,
    decoupled: bool = True,
    scale: float = 1.0,
) -> None:
    """One Coupled Adam step of the (V, H) `param` in place (module docstring), its `state`
    (``step``, ``exp_avg``, ``exp_avg_sq``) created on first use. `weight_decay` is AdamW's
    decoupled decay (``decoupled``) or Adam's L2 term added to the gradient. Call under
    ``torch.no_grad``."""
    beta1, beta2 = betas
    init_state(param, state)
    p, g = local_part(param), local_part(grad)
    if state["step"].device != p.device:  # a checkpoint loaded onto the host
        state["step"] = state["step"].to(p.device)
    m, v, step = local_part(state["exp_avg"]), local_part(state["exp_avg_sq"]), state["step"]
    step += 1
    if weight_decay != 0:
        if decoupled:
            p.mul_(1 - lr * weight_decay)
        else:
            g = g.add(p, alpha=weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    t = step.to(torch.float64)
    bias1, bias2 = 1 - torch.pow(beta1, t), 1 - torch.pow(beta2, t)
    mean_v = row_mean(state["exp_avg_sq"])  # (H,), over every row of every shard
    denominator = (mean_v * scale / bias2.to(mean_v.dtype)).sqrt() + eps
    # torch's capturable form: the step size folded into the (H,) denominator, one fused addcdiv over E
    p.addcdiv_(m, (denominator / (lr / bias1).to(mean_v.dtype)).to(m.dtype).expand_as(m), value=-1.0)


def init_state(param: torch.Tensor, state: dict) -> None:
    """Adam's state of `param` where `state` is empty: step 0 (on the device), m = v = 0."""
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=local_part(param).device)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def innermost(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer a wrapper steps (accelerate's ``AcceleratedOptimizer``, Lightning's
    ``LightningOptimizer``: each holds it as ``.optimizer``)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


class CoupledAdam:
    """Coupled Adam for `params` (each (V, H): the output embedding) inside the trainer's own
    `optimizer` (a `torch.optim.Adam` or `AdamW`, unwrapped by `innermost`), through its step
    hooks (module docstring); `remove` hands the optimizer back as it was.

    decay: apply the group's weight decay to `params` (AdamW's decoupled form for AdamW or
        ``decoupled_weight_decay=True``, Adam's L2 term otherwise); scale: s of v̄."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], *, decay: bool = False,
                 scale: float = 1.0) -> None:
        optimizer = innermost(optimizer)
        if not isinstance(optimizer, torch.optim.Adam):
            raise ConfigError(
                f"method='coupled_adam' changes Adam's update of the output embedding, but the trainer's optimizer is "
                f"{type(optimizer).__module__}.{type(optimizer).__name__}: use torch.optim.AdamW (HF Trainer: "
                "optim='adamw_torch' or 'adamw_torch_fused'; Lightning: return it from configure_optimizers; "
                "torchtitan: --optimizer.name AdamW)"
            )
        self.optimizer, self.params, self.decay, self.scale = optimizer, list(params), decay, scale
        for p in self.params:
            group = self._group_of(p)
            for key in ("amsgrad", "maximize", "differentiable"):
                if group.get(key):
                    raise ConfigError(f"method='coupled_adam': the optimizer group of the output embedding has "
                                      f"{key}=True, which Coupled Adam does not define; set it False")
        self._held: list[tuple[dict, list]] = []
        self._handles = [
            optimizer.register_step_pre_hook(self._take_out),
            optimizer.register_step_post_hook(self._step_coupled),
            optimizer.register_state_dict_pre_hook(lambda _: self._put_back()),
        ]

    def _group_of(self, param: torch.Tensor) -> dict:
        for group in self.optimizer.param_groups:
            if any(q is param for q in group["params"]):
                return group
        raise ConfigError(
            f"method='coupled_adam': the output embedding's weight {tuple(param.shape)} is in no group of the trainer's "
            f"{type(self.optimizer).__name__}: let the trainer's optimizer train the LM head"
        )

    def _take_out(self, optimizer, args, kwargs) -> tuple[tuple, dict] | None:
        """Step pre-hook: E leaves its group. A closure (Lightning's: forward, ``zero_grad``,
        backward inside ``step``) runs with E back in its group, so that its gradient is zeroed."""
        self._groups = [self._group_of(p) for p in self.params]
        self._hide()
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0] is the optimizer
        if closure is None:
            return None

        def with_params_in_groups():
            self._put_back()
            try:
                return closure()
            finally:
                self._hide()

        if "closure" in kwargs:
            return args, {**kwargs, "closure": with_params_in_groups}
        return (args[0], with_params_in_groups, *args[2:]), kwargs

    def _hide(self) -> None:
        self._put_back()
        for group in {id(g): g for g in self._groups}.values():
            self._held.append((group, group["params"]))
            group["params"] = [q for q in group["params"] if not any(q is p for p in self.params)]

    def _put_back(self) -> None:
        for group, params in self._held:
            group["params"] = params
        self._held = []

    def _step_coupled(self, optimizer, args, kwargs) -> None:
        self._put_back()
        grad_scale, found_inf = getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None)
        with torch.no_grad():
            for p, group in zip(self.params, self._groups):
                if p.grad is None:
                    continue
                grad = p.grad if grad_scale is None else p.grad / grad_scale
                state = optimizer.state[p]
                init_state(p, state)
                kept = None if found_inf is None else {k: local_part(t).clone() for k, t in (*state.items(), ("p", p))}
                coupled_adam_update(
                    p, grad, state, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                    weight_decay=group["weight_decay"] if self.decay else 0.0,
                    decoupled=group.get("decoupled_weight_decay", False), scale=self.scale,
                )
                if kept is not None:  # the fused kernel's rule: no change where the scaled gradients overflowed
                    skip = found_inf.to(torch.bool)
                    for key, old in kept.items():
                        target = local_part(p if key == "p" else state[key])
                        target.copy_(torch.where(skip.to(target.device), old, target))

    def remove(self) -> None:
        self._put_back()
        for handle in self._handles:
            handle.remove()
        self._handles = []


__all__ = ["CoupledAdam", "coupled_adam_update", "init_state", "innermost"]
