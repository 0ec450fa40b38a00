"""The options of the fused loss (docs/methods.md §16, docs/performance.md §1.1): fields of
`aniso_plugins.AnisoConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from aniso_plugins.core.errors import ConfigError
from aniso_plugins.core.options import Options, check_positive_or_none


@dataclass(frozen=True)
class FusedLossOptions(Options):
    """The fused chunked cross-entropy in place of the model's training loss."""

    fused_loss: bool | None = None
    """Compute the training loss in the LM head, chunk by chunk (no (N, V) logits; AGG-gated
    when AGG is on). None (default): when AGG is on and the adapter reproduces the model's own
    loss exactly (torchtitan's cross-entropy; in HF and Lightning, causal LMs that compute their
    loss from the head's logits with transformers' loss function), and, with any method acting
    in the head, where the trainer's own loss is chunked (TRL's SFTTrainer, Liger-Kernel's fused
    linear cross-entropy: answered by the head, chunk by chunk); else the model's own loss, with
    an info line saying why. True: also without AGG; an error where it cannot be exact. False:
    never (AGG then runs as the gated head; a chunked trainer loss takes the head's logits)."""
    fused_chunk_size: int | None = None
    """Token rows per tile of the fused loss (each tile holds the whole vocabulary of its rows);
    None: tiles of the bytes of PyTorch's ``F.linear_cross_entropy`` chunk, its memory floor
    (`aniso_plugins.methods.fused_loss.passes.plan_tiles`: its whole rows where 64 or more,
    else vocabulary blocks with one more logits GEMM). 1024: the 0.1 default's speed and memory."""

    def validate(self) -> None:
        if self.fused_loss not in (None, True, False):
            raise ConfigError(f"fused_loss={self.fused_loss!r}: expected True, False or None (automatic)")
        check_positive_or_none("fused_chunk_size", self.fused_chunk_size)


__all__ = ["FusedLossOptions"]
