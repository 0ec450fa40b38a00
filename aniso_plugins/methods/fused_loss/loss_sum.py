"""`FusedLossSum`: what the fused loss head returns where a model's forward goes on to transform
its logits (a soft-cap, a scale), and the check that the forward's transform is the one the fused
loss applied.

A model whose forward applies ``c·tanh(s·z/c)`` or ``s·z`` to its head's output before its loss
(Gemma 2/3, Cohere, Granite, Falcon-H1) receives from the fused head (`TrainingHead`) its summed
token loss, the transform already applied to every logit (`LogitTransform`). The forward's own
``/ x``, ``* x`` and ``tanh`` then pass that sum through unchanged and are recorded; the loss
function the adapter installed reads it back with `fused_sum`, which checks them against the
transform fused at set-up (`transform_of`)."""

from __future__ import annotations

import math

import torch

from aniso_plugins.methods.fused_loss.logit_transform import LogitTransform

IDENTITY = LogitTransform()
"""The transform of a forward that passes its head's output on unchanged."""


def transform_of(ops: list[tuple]) -> LogitTransform | str:
    """The `LogitTransform` of elementwise operations in order (("mul", x), ("div", x),
    ("tanh",)): linear ones before an optional tanh scale it, linear ones after it are the cap
    (c·tanh(k·z): scale k·c, soft-cap c > 0); or why they are not of that form."""
    tanh = [i for i, op in enumerate(ops) if op[0] == "tanh"]

    def product(part: list[tuple]) -> float:
        out = 1.0
        for kind, x in part:
            out = out * x if kind == "mul" else out / x
        return out

    if not tanh:
        scale, cap = product(ops), None
    elif len(tanh) > 1:
        return "applies tanh more than once to its logits"
    else:
        cap = product(ops[tanh[0] + 1 :])
        if not cap > 0:
            return f"scales tanh of its logits by {cap}, not a positive soft-cap"
        scale = product(ops[: tanh[0]]) * cap
    if not (math.isfinite(scale) and scale != 0 and (cap is None or math.isfinite(cap))):
        return f"multiplies its logits by {scale}, which no loss can be fused through"
    return LogitTransform(scale, cap)


_PASSED_THROUGH = {
    torch.Tensor.__truediv__: "div", torch.Tensor.div: "div", torch.div: "div", torch.true_divide: "div",
    torch.Tensor.__mul__: "mul", torch.Tensor.__rmul__: "mul", torch.Tensor.mul: "mul", torch.mul: "mul",
    torch.tanh: "tanh", torch.Tensor.tanh: "tanh",
}  # fmt: skip


class FusedLossSum(torch.Tensor):
    """The head's fused loss sum (0-dim), or TRL's per-token log-probabilities, handed back where
    the logits would be, for a model whose
    forward goes on to transform them elementwise (a soft-cap, a scale): the fused loss applied
    that transform to every logit already, so the forward's ``/ x``, ``* x`` and ``tanh`` return
    this value unchanged and are recorded (`ops`), and the loss function checks them against the
    transform fused (`checked`). Any other operation gives a plain tensor."""

    ops: list[tuple]

    @classmethod
    def wrap(cls, loss: torch.Tensor) -> FusedLossSum:
        out = loss.as_subclass(cls)  # the same value and autograd graph
        out.ops = []
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kind = _PASSED_THROUGH.get(func)
        if kind is not None and not kwargs and args and isinstance(args[0], cls):
            value, rest = args[0], args[1:]
            x = rest[0].item() if len(rest) == 1 and isinstance(rest[0], torch.Tensor) and rest[0].numel() == 1 else (
                rest[0] if len(rest) == 1 else None)
            if kind == "tanh" and not rest:
                value.ops.append(("tanh",))
                return value
            if kind != "tanh" and isinstance(x, (int, float)) and not isinstance(x, bool):
                value.ops.append((kind, float(x)))
                return value
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def checked(self, expected: LogitTransform) -> torch.Tensor:
        """The loss sum as a plain tensor, once the recorded operations are `expected`'s; raises
        if the forward transformed the value otherwise (the fused loss would not be its loss)."""
        got = transform_of(self.ops)
        if isinstance(got, str) or not _same_transform(got, expected):
            raise RuntimeError(
                f"the fused loss applied the logit transform {expected} read from the model at set-up, "
                f"but its forward applied {self.ops}; set AnisoConfig(fused_loss=False) and report the model"
            )
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor)


def _same_transform(a: LogitTransform, b: LogitTransform) -> bool:
    return math.isclose(a.scale, b.scale, rel_tol=1e-12) and (a.softcap is None) == (b.softcap is None) and (
        a.softcap is None or math.isclose(a.softcap, b.softcap, rel_tol=1e-12))


def fused_sum(logits: torch.Tensor, transform: LogitTransform) -> torch.Tensor:
    """The head's summed token loss from what the model's forward passed where its logits would
    be (a 0-dim tensor): a `FusedLossSum` checked against `transform`, or, for the identity, the
    tensor itself. Raises where a transform was expected and the value lost its wrapper (an
    operation the forward applied that the fused loss did not)."""
    if isinstance(logits, FusedLossSum):
        return logits.checked(transform)
    if not transform.identity:
        raise RuntimeError(
            f"the fused loss expected the model's forward to pass its transformed sum through (transform {transform}), "
            "but an operation it does not know replaced it; set AnisoConfig(fused_loss=False)"
        )
    return logits


__all__ = ["IDENTITY", "FusedLossSum", "fused_sum", "transform_of"]
