"""The training forward installed in place on an LM head module: AGG's gated logits and the
fused chunked cross-entropy (the one forward any plugin arms, in every adapter). The math lives
in `aniso_plugins.methods.fused_loss.linear` (`gated_linear`) and
`aniso_plugins.methods.fused_loss.cross_entropy` (`fused_linear_cross_entropy`); this module only
decides which one a call runs."""

from __future__ import annotations

import logging

import torch
from torch import nn

from aniso_plugins.core.errors import SetupError
from aniso_plugins.core.steps import TargetChunks
from aniso_plugins.methods.fused_loss.cross_entropy import fused_linear_cross_entropy
from aniso_plugins.methods.fused_loss.linear import gated_linear
from aniso_plugins.methods.fused_loss.logit_transform import LogitTransform
from aniso_plugins.methods.fused_loss.passes import FLOOR_ROWS
from aniso_plugins.methods.fused_loss.loss_sum import FusedLossSum
from aniso_plugins.methods.fused_loss.row_gates import RowGates
from aniso_plugins.methods.heads.lowrank import LowRankHead
from aniso_plugins.numerics.distributed import VocabShard
from aniso_plugins.numerics.linalg import ROW_BLOCK

logger = logging.getLogger("aniso_plugins")


class TrainingHead:
    """The training forward, installed in place on an LM head module: the one installed head.

    The module object and its Parameters stay what they are (tying, state-dict keys, FSDP2
    groups and DDP hooks keep working); only ``module.forward`` becomes an instance attribute.
    Plugins share it (`of` installs it or returns the installed one). Per training micro-batch,
    `arm` hands over the targets and, from AGG, the gates of the weight gradient; `fuse` (only
    where the adapter owns the loss) makes the head compute the loss. The next forward(s) that
    run in training mode with gradients enabled consume them, reading ``module.weight`` (and
    ``module.bias``) at call time, where FSDP2 has unsharded them (a head whose ``weight`` is a
    computed property, W = A·B, works too), and return either

    - the logits of `gated_linear` (plain values, gated weight gradient), one chunk of the
      targets per call when the adapter runs the head in ``chunks`` pieces (torchtitan's
      chunked loss), or
    - fused, the chunked cross-entropy of the whole micro-batch, ``Σ_{i: y_i ≠ ignore} CE_i /
      normalizer`` (`aniso_plugins.fused_linear_cross_entropy`, AGG-gated when armed with gates, label
      smoothed with ``label_smoothing``), a 0-dim tensor: never the full logits; or, fused with
      ``token_outputs`` (TRL's fused LM head, `ParallelLayout.token_outputs`), each position's
      log-probability log p_i(y_i) = −CE_i (0 where ignored; its gradient AGG-gated likewise) in
      the targets' shape, and the token outputs asked for kept for `take_token_outputs`.

    Any other call runs the module's original forward. `remove` restores it.

    shard: under tensor parallelism with loss parallel, the vocabulary shard whose rows
    ``module.weight`` holds inside the forward (`ModelHandle.vocab_mesh`): both forwards then
    run on the shard (`gated_linear` returns the shard's logits; the fused loss is the whole
    vocabulary's, its reductions over the shard group). backward_twice: the trainer runs the
    backward twice (`ModelHandle.backward_runs_twice`). logit_transform: the soft-cap or scale the
    model's forward applies to the head's output before its loss (`ModelHandle.logit_transform`):
    the fused loss applies it to every logit and returns its sum as a `FusedLossSum`
    (`aniso_plugins.methods.fused_loss.loss_sum`), which the forward's own transform passes through.
    """

    def __init__(self, module: nn.Module, ignore_index: int = -100, chunk_size: int | None = None,
                 shard: VocabShard | None = None, backward_twice: bool = False,
                 logit_transform: LogitTransform | None = None) -> None:
        check_linear_head(module, framework_forward=True)  # the caller checked the head
        self.module = module
        self.ignore_index = ignore_index
        self.chunk_size = chunk_size
        self.shard = shard
        self.backward_twice = backward_twice
        self.logit_transform = None if logit_transform is None or logit_transform.identity else logit_transform
        self.gated = False
        """Whether a plugin gates the weight gradient (AGG): it arms every micro-batch with gates."""
        self._own_forward = "forward" in module.__dict__
        self._original = module.forward
        self._targets: TargetChunks | None = None
        self._whole: torch.Tensor | None = None
        self._gates: RowGates | None = None
        self._fused: tuple[torch.Tensor | None, float, tuple[str, ...] | None] | None = None  # fuse's arguments
        self._warned = False
        self._token_outputs: dict[str, torch.Tensor] = {}
        module.forward = self.forward

    @classmethod
    def installed_on(cls, module: nn.Module) -> TrainingHead | None:
        """The training head installed on `module`, or None."""
        installed = getattr(module.forward, "__self__", None)
        return installed if isinstance(installed, cls) else None

    def arm(self, targets: torch.Tensor, gates: RowGates | None = None, *, chunks: int = 1) -> None:
        """One micro-batch's targets (aligned with the head's output positions) and gates for
        the next forward, or for the next `chunks` forwards (equal chunks of the last target
        dimension, in order)."""
        self._targets = TargetChunks(targets, chunks)
        self._whole = targets
        self._gates = gates
        self._fused = None

    def fuse(self, normalizer: torch.Tensor | None = None, label_smoothing: float = 0.0,
             token_outputs: tuple[str, ...] | None = None) -> None:
        """The armed micro-batch's next forward (one call on the whole micro-batch, whatever
        `arm`'s ``chunks``) returns its fused loss: the summed token loss divided by `normalizer`
        (None: the sum), label-smoothed by `label_smoothing`; with `token_outputs`, each position's
        log-probability and those outputs (the class docstring)."""
        if self._targets is None:
            raise ValueError("TrainingHead.fuse: arm the micro-batch first")
        self._targets = TargetChunks(self._whole, 1)
        self._fused = (normalizer, label_smoothing, token_outputs)

    def disarm(self) -> None:
        """Drop targets that no forward consumed."""
        self._targets = self._whole = self._gates = self._fused = None

    def take_token_outputs(self) -> dict[str, torch.Tensor]:
        """The token outputs (name -> tensor in the targets' shape, detached) of the last per-token
        call (`fuse` with ``token_outputs``), handed over once: the trainer's loss reads them
        beside the log-probabilities, whatever an engine's hooks did to the head's output."""
        taken, self._token_outputs = self._token_outputs, {}
        return taken

    @property
    def armed(self) -> bool:
        return self._targets is not None and not self._targets.exhausted

    def remove(self) -> None:
        """Restore the module's original forward."""
        if self._own_forward:
            self.module.forward = self._original
        else:
            del self.module.forward
        self.disarm()

    def forward(self, input: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # noqa: A002 - torchtitan reads `input`
        if self.module.training and torch.is_grad_enabled():
            if self.armed and (self._fused is not None or self._gates is not None):
                if args or kwargs:
                    raise TypeError("the training head takes only the hidden states")
                return self._training(input)
            if self.gated and not self._warned:
                self._warned = True
                logger.warning(
                    "AGG: the LM head ran in training without targets for this micro-batch; its weight "
                    "gradient is not gated (the adapter must announce each micro-batch before its forward)"
                )
            self.disarm()
        return self._original(input, *args, **kwargs)

    def _training(self, hidden: torch.Tensor) -> torch.Tensor:
        targets, gates, fused = self._targets.take(), self._gates, self._fused
        weight, bias = self.module.weight, getattr(self.module, "bias", None)
        if self._targets.exhausted:
            self.disarm()
        if fused is None:
            return gated_linear(hidden, weight, targets, gates, bias, self.ignore_index, self.shard)
        normalizer, smoothing, tokens = fused
        if tokens is not None:
            return self._token_log_probs(hidden, weight, bias, targets, gates, tokens)
        loss = fused_linear_cross_entropy(
            hidden,
            weight,
            targets,
            gates,
            bias=bias,
            ignore_index=self.ignore_index,
            reduction="sum",
            normalizer=normalizer,
            chunk_size=self.chunk_size,
            label_smoothing=smoothing,
            shard=self.shard,
            backward_twice=self.backward_twice,
            logit_transform=self.logit_transform,
        )
        return loss if self.logit_transform is None else FusedLossSum.wrap(loss)


    def _token_log_probs(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         targets: torch.Tensor, gates: RowGates | None, tokens: tuple[str, ...]) -> torch.Tensor:
        """log p_i(y_i) of every position (−CE_i, 0 where ignored; a `FusedLossSum` through a logit
        transform); the outputs `tokens` kept for `take_token_outputs`."""
        rows = self.chunk_size or token_tile_rows(targets.numel(), weight.shape[0] if self.shard is None else self.shard.total)
        out = fused_linear_cross_entropy(
            hidden, weight, targets, gates, bias=bias, ignore_index=self.ignore_index, reduction="none",
            chunk_size=rows, shard=self.shard, logit_transform=self.logit_transform,
            token_outputs=tokens, return_lse=not tokens,
        )
        self._token_outputs = {name: getattr(out, name) for name in tokens}
        return -out.loss if self.logit_transform is None else FusedLossSum.wrap(-out.loss)


TOKEN_TILE_LOGITS = 4096 * 32768
"""The logits of TRL's chunked head's tile (``trl.kernels.chunked_logprob``: 4096 tokens × 32768
ids): a per-token call that answers TRL's head holds at most as many at a time (`token_tile_rows`)."""


def token_tile_rows(n: int, v: int) -> int | None:
    """Token rows per whole-row tile of a per-token call of `n` rows over `v` ids: the power of two
    whose tile fits in TRL's at its `n` (`TOKEN_TILE_LOGITS`, at most `ROW_BLOCK` rows), or None (the
    default plan) where fewer than `FLOOR_ROWS` would fit."""
    fit = min(n, 4096) * (TOKEN_TILE_LOGITS // 4096) // max(v, 1)
    if fit < FLOOR_ROWS:
        return None
    return min(1 << (fit.bit_length() - 1), ROW_BLOCK)


LINEAR_FORWARDS = (nn.Linear.forward, LowRankHead.forward)
"""Forwards known to compute exactly ``F.linear(x, module.weight, module.bias)`` (up to rounding)."""


def check_linear_head(module: nn.Module, framework_forward: bool = False, who: str = "AGG") -> None:
    """Raise `SetupError` unless `module`'s forward is exactly a linear map of its ``weight``
    (and ``bias``): the training head replaces that forward by ``gated_linear(x, weight, ...)``
    or the fused loss, so anything else it computes (a logit scale, a soft-cap, a norm) would
    silently be lost. `who` names the feature in the message.
    `framework_forward`: the trainer sets an instance forward around the class forward that
    changes no value (`ModelHandle.framework_wraps_head_forward`)."""
    name = type(module).__qualname__
    if TrainingHead.installed_on(module) is not None:
        raise SetupError(
            f"the LM head {name} already has an aniso training forward installed, by a session that was not detached "
            "(e.g. a notebook cell run twice): call .detach() on the callback that installed it, or "
            "aniso_plugins.detach(model), then attach again"
        )
    if "forward" in module.__dict__ and not framework_forward:
        raise SetupError(
            f"the LM head {name} has a forward of its own set on the instance ({module.forward!r}); {who} would "
            f"replace it. Remove that patch, or train without {who}"
        )
    if type(module).forward not in LINEAR_FORWARDS:
        raise SetupError(
            f"{who} needs an LM head whose forward is exactly F.linear(x, weight, bias); {name}.forward is code of "
            "its own (e.g. a logit scale or soft-cap), which the gated forward would bypass and silently change "
            "the logits. Use an nn.Linear head and apply the extra computation after it in the model's forward, "
            f"or train without {who}"
        )


__all__ = ["LINEAR_FORWARDS", "TOKEN_TILE_LOGITS", "TrainingHead", "check_linear_head", "token_tile_rows"]
