"""SimCTG's token-level contrastive loss (Su et al., NeurIPS 2022, "A Contrastive Framework for
Neural Text Generation", §3.1 eq. 2), docs/methods.md §12.

On the last hidden states h_1..h_T of a sequence (the LM head's input), with s the cosine
similarity and margin ρ:

    L_CL = Σ_i Σ_{j≠i} max(0, ρ − s(h_i, h_i) + s(h_i, h_j)),    s(h_i, h_i) = 1,

over the ordered pairs of *valid* positions i ≠ j of the same sequence (pairs never cross
sequences: neither rows nor, in a packed row, examples; `segments`), divided by the number of
such pairs in the whole batch, Σ_s n_s(n_s − 1) over the sequences s. This
pooled normalisation is the official code's (yxuansu/SimCTG, ``contrastive_loss``: the sum of
the masked loss matrix over the sum of the mask); with equal lengths n_b = T it is the paper's
1/(T(T − 1)) per sequence averaged over sequences.

Exact and blockwise over query positions: memory O(B·T·block) beyond the (B, T, d) inputs,
never a (B, T, T) matrix; time O(B·T²·d). The hinge's gradient with respect to the unit vectors,
∂/∂ĥ_i = 2 Σ_{j≠i} 1[s_ij > 1 − ρ] ĥ_j (the active mask is symmetric), is accumulated in the
forward block by block; the normalisation ĥ = h / ‖h‖ is differentiated by autograd. Cosines
are computed in float32 (float64 for float64 input, autocast off), sums in float64.
"""

from __future__ import annotations

import torch


def _unit(hidden: torch.Tensor) -> torch.Tensor:
    """ĥ = h / ‖h‖ in float32 (float64 stays float64); a zero vector stays 0 (cosine 0, no NaN)."""
    x = hidden.to(torch.promote_types(hidden.dtype, torch.float32))
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    nonzero = norm > 0
    return x * (nonzero / torch.where(nonzero, norm, torch.ones_like(norm)))


class _PairHinge(torch.autograd.Function):
    """Σ_b Σ_{i≠j valid} max(0, ĥ_iᵀĥ_j − threshold) with threshold = 1 − ρ, as a float64 0-d
    tensor; its gradient w.r.t. the unit vectors is computed and saved in the forward."""

    @staticmethod
    def forward(
        ctx, unit: torch.Tensor, valid: torch.Tensor, segments: torch.Tensor | None, threshold: float, block: int
    ) -> torch.Tensor:
        _, length, _ = unit.shape
        grad = torch.zeros_like(unit) if ctx.needs_input_grad[0] else None
        value = torch.zeros((), dtype=torch.float64, device=unit.device)
        weight = valid.to(unit.dtype)
        keys = unit.transpose(1, 2)  # (B, d, T)
        for start in range(0, length, block):
            stop = min(start + block, length)
            excess = torch.bmm(unit[:, start:stop], keys).sub_(threshold).clamp_min_(0.0)  # (B, n, T)
            excess.mul_(weight.unsqueeze(1)).mul_(weight[:, start:stop].unsqueeze(2))
            if segments is not None:  # pairs within one example of a packed row
                excess.mul_(segments[:, start:stop].unsqueeze(2) == segments.unsqueeze(1))
            excess[:, :, start:stop].diagonal(dim1=1, dim2=2).zero_()  # j = i
            value += excess.sum(dtype=torch.float64)
            if grad is not None:  # excess >= 0, so its sign is the active mask 1[s_ij > 1 − ρ]
                grad[:, start:stop] = torch.bmm(excess.sign_(), unit)
        if grad is not None:
            grad.mul_(2.0)
        ctx.save_for_backward(grad)
        return value

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad * grad_out.to(grad.dtype), None, None, None, None


def _check(hidden: torch.Tensor, valid: torch.Tensor, block: int, segments: torch.Tensor | None) -> None:
    if hidden.dim() < 2 or valid.shape != hidden.shape[:-1]:
        raise ValueError(
            f"SimCTG: hidden must be (..., T, d) and valid (..., T) with the same leading shape, got "
            f"{tuple(hidden.shape)} and {tuple(valid.shape)}"
        )
    if valid.dtype != torch.bool:
        raise ValueError(f"SimCTG: valid must be a bool mask (targets != ignore_index), got {valid.dtype}")
    if not hidden.is_floating_point():
        raise ValueError(f"SimCTG: hidden must be a floating-point tensor, got {hidden.dtype}")
    if segments is not None and segments.shape != valid.shape:
        raise ValueError(
            f"SimCTG: segments must have the shape of valid {tuple(valid.shape)}, got {tuple(segments.shape)}"
        )
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"SimCTG: block={block!r}: expected an integer >= 1 (query positions per block)")


def simctg_pair_count(valid: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_s n_s(n_s − 1), the number of ordered pairs of valid positions i ≠ j within the same
    sequence, for a bool mask (..., T); with `segments` ((..., T) example ids of packed rows,
    `aniso_plugins.StepInfo.sequence_ids`) a sequence is one example of a row. An int64 0-d
    tensor on `valid`'s device."""
    rows = valid.reshape(-1, valid.shape[-1])
    if segments is None:
        n = rows.sum(-1, dtype=torch.int64)
    else:
        length = rows.shape[-1]
        seg = segments.reshape(rows.shape).to(device=rows.device, dtype=torch.int64)
        offset = seg - seg.min(-1, keepdim=True).values  # 0 <= offset < T per row
        keys = (torch.arange(rows.shape[0], device=rows.device).unsqueeze(1) * length + offset)[rows]
        n = torch.bincount(keys, minlength=1).to(torch.int64)
    return (n * (n - 1)).sum()


def simctg_pair_sums(
    hidden: torch.Tensor,
    valid: torch.Tensor,
    margin: float = 0.5,
    block: int = 512,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ pair losses, pair count) of SimCTG's contrastive loss on `hidden` (..., T, d) at the
    positions where the bool mask `valid` (..., T) is True: the sum of
    max(0, ρ − 1 + cos(h_i, h_j)) over the ordered valid pairs i ≠ j of each sequence (a
    differentiable float64 0-d tensor), and `simctg_pair_count(valid, segments)`; `segments`
    (..., T) splits packed rows into their examples (pairs only within one). `block` query
    positions are processed at a time (memory O(B·T·block)); the result does not depend on it."""
    _check(hidden, valid, block, segments)
    length, dim = hidden.shape[-2:]
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        unit = _unit(hidden).reshape(-1, length, dim)
        seg = None if segments is None else segments.reshape(-1, length).to(unit.device)
        total = _PairHinge.apply(unit, valid.reshape(-1, length), seg, 1.0 - float(margin), block)
    return total, simctg_pair_count(valid, segments)


def simctg_loss(
    hidden: torch.Tensor,
    valid: torch.Tensor,
    margin: float = 0.5,
    block: int = 512,
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """L_CL of one batch: `simctg_pair_sums` divided by the pair count (0 when there is no
    pair), the official SimCTG normalisation. A differentiable float64 0-d tensor."""
    total, count = simctg_pair_sums(hidden, valid, margin, block, segments)
    return total / count.clamp_min(1).to(total.dtype)


__all__ = ["simctg_loss", "simctg_pair_count", "simctg_pair_sums"]
