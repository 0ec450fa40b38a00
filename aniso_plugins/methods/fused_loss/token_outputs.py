"""The per-token outputs of a chunked LM head (`fused_linear_cross_entropy`'s token outputs),
computed from each tile's statistics, never from the N × V logits:

    lse_i = log Σ_k exp z'_ik                       (Cut Cross-Entropy's ``return_lse``)
    entropy_i = lse_i − Σ_k p_ik z'_ik               (TRL's ``entropy``)
    log_sum_sq_probs_i = log Σ_k p_ik² = log Σ_k exp 2z'_ik − 2·lse_i
    mean_logits_i = Σ_k z'_ik / V
    predicted_i = argmax_k z'_ik (the first id of the maximum; −1 where ignored: Liger-Kernel's)
    is_top1_i = [predicted_i = y_i] (False where ignored),  token accuracy = Σ_i is_top1_i / #non-ignored

with z'_i the row's transformed logits (`LogitTransform`) and p_i = softmax(z'_i)."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["FusedCrossEntropyOutput", "TOKEN_OUTPUTS", "checked_outputs"]

TOKEN_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
"""The names `token_outputs` takes: the optional fields of TRL's ``FusedCausalLMOutput``."""


def checked_outputs(token_outputs: tuple[str, ...], flags: bool, shard: object) -> bool:
    """Whether the call computes token outputs, after checking their names (the value and the fix)."""
    if isinstance(token_outputs, str) or any(name not in TOKEN_OUTPUTS for name in token_outputs):
        raise ValueError(f"token_outputs={token_outputs!r}: expected a tuple of names among {TOKEN_OUTPUTS}")
    wanted = bool(token_outputs) or flags
    if wanted and shard is not None:
        raise ValueError("fused_linear_cross_entropy: token outputs (return_lse, return_token_accuracy, "
                         "return_predicted_tokens, token_outputs) are not computed on a vocabulary shard; leave them unset")
    return wanted


class FusedCrossEntropyOutput(NamedTuple):
    """What `fused_linear_cross_entropy` returns when a token output is asked for: the loss, then
    each output asked for (None for the others), per position in the targets' shape (module
    docstring), detached. `token_accuracy`: per position (``reduction="none"``) or the mean over
    the non-ignored positions (0 where there is none)."""

    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None
    predicted_tokens: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None

    @classmethod
    def of(cls, loss: torch.Tensor, z_part: torch.Tensor, stats: torch.Tensor, argmax: torch.Tensor,
           targets: torch.Tensor, ignore_index: int, reduction: str, flags: tuple[bool, bool, bool, bool],
           token_outputs: tuple[str, ...]) -> FusedCrossEntropyOutput:
        """The output from the op's stacked statistics (lse, entropy, log Σ p², mean logit) and
        argmax; `flags`: return_z_loss, return_lse, return_token_accuracy, return_predicted_tokens."""
        z_loss, lse, accuracy, predicted = flags
        valid = targets != ignore_index
        top1 = (argmax == targets) & valid
        fields = dict(zip(("lse", "entropy", "log_sum_sq_probs", "mean_logits"), stats.detach().unbind(0)))
        out = {name: fields[name] for name in TOKEN_OUTPUTS[:3] if name in token_outputs}
        if "is_top1" in token_outputs:
            out["is_top1"] = top1
        if lse:
            out["lse"] = fields["lse"]
        if predicted:
            out["predicted_tokens"] = torch.where(valid, argmax, -1)
        if accuracy:
            hits = top1.to(stats.dtype)
            out["token_accuracy"] = hits if reduction == "none" else hits.sum() / valid.sum().clamp_min(1).to(stats.dtype)
        return cls(loss, z_part.detach() if z_loss else None, **out)
