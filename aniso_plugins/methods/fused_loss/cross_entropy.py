"""Fused, chunked linear + cross-entropy (optionally label-smoothed and AGG-gated): never the
full N×V logits.

The approach of Liger-Kernel's fused linear cross-entropy (docs/performance.md §1.1): the forward
walks over chunks of token rows, computes a chunk of logits, its loss and its logit gradient
G_c = (softmax − onehot)/normalizer, projects it at once (dX_c = G_c W, dW += G_cᵀ X_c) and
keeps only dX, dW, db for the backward, which scales them by the incoming scalar gradient.
AGG's Γ (`aniso_plugins.methods.agg.gates`) costs no N×V pass: rows are ordered so that the larger row group
(non-rare or rare targets) comes first; its chunks accumulate unscaled, then dW is scaled once
by that group's gate vector, the smaller group's chunks are multiplied in place by theirs, and
target entries are corrected at the end with one index_add (docs/performance.md §3.2, §6.1).
Ignored rows (``ignore_index``) are skipped: they have no loss and no gradient. Label smoothing ε
(as transformers' ``LabelSmoother``) adds ε·mean_k(−log p_ik) to each row's (1 − ε)·CE: in the
same pass, one more row sum of the logits chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aniso_plugins.methods.agg.gates import AGGGates, addmm_in_, check_inputs, compute_dtypes, row_gating
from aniso_plugins.numerics.linalg import ROW_BLOCK

__all__ = ["agg_cross_entropy", "default_chunk_rows"]

CHUNK_LOGITS_BYTES = 256 * 2**20
"""Budget of one float32 logits chunk when ``chunk_size`` is None (`default_chunk_rows`)."""
MIN_CHUNK_ROWS = 256
"""Fewest default rows per chunk: smaller GEMMs and a dW pass per chunk are slow (docs/performance.md §1.1)."""


def default_chunk_rows(vocab: int) -> int:
    """Token rows per chunk when ``chunk_size`` is None: ``ROW_BLOCK`` (1024), or fewer where 1024
    rows of float32 logits would exceed `CHUNK_LOGITS_BYTES` (V > 65536): 512 at V = 131072, 256
    at V = 262144, never fewer than `MIN_CHUNK_ROWS`. Up to V = 262144 the peak is then dW + dX +
    at most 256 MiB of logits, instead of growing by 4 KiB per vocabulary entry
    (docs/performance.md §7.3)."""
    return max(MIN_CHUNK_ROWS, min(ROW_BLOCK, CHUNK_LOGITS_BYTES // (4 * vocab)))


def _row_order(y: torch.Tensor, valid: torch.Tensor, gates, acc: torch.dtype):
    """The valid rows in chunk order and where the second group starts: ungated, all valid rows
    (split = their count); gated, first the rows of the larger group (gate ``base``), then those
    of the smaller one (`row_gating`'s ``in_other``), so each chunk has one gate pattern."""
    if gates is None:
        rows = valid.nonzero().squeeze(1)
        return rows, rows.numel(), None
    rg = row_gating(gates, y, valid, acc)
    first = (valid & ~rg.in_other).nonzero().squeeze(1)
    second = (valid & rg.in_other).nonzero().squeeze(1)
    return torch.cat([first, second]), first.numel(), rg


def _add_target_rows(dw: torch.Tensor, coef: torch.Tensor, X: torch.Tensor, rows: torch.Tensor,
                     ys: torch.Tensor, chunk_size: int) -> None:
    """dW[y_i] += coef_i · x_i over the ordered rows, chunk by chunk (the gated target-row
    correction: row y_i of the gradient keeps its own gate)."""
    for s in range(0, rows.numel(), chunk_size):
        dw.index_add_(0, ys[s : s + chunk_size], coef[s : s + chunk_size, None] * X[rows[s : s + chunk_size]].to(dw.dtype))


class _FusedAGGCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, gates, ignore_index, scale, chunk_size, smoothing, dtypes, grad_enabled):
        compute, acc, _ = dtypes
        v, d = weight.shape
        want_dx, want_dw, want_db = (grad_enabled and need for need in ctx.needs_input_grad[:3])
        with torch.autocast(hidden.device.type, enabled=False):
            X = hidden.reshape(-1, d)
            y = targets.reshape(-1)
            rows, split, rg = _row_order(y, y != ignore_index, gates, acc)
            n = rows.numel()
            ys = y[rows]
            w = weight.to(compute)
            b = None if bias is None else bias.to(compute)
            dx = torch.zeros(X.shape, dtype=hidden.dtype, device=X.device) if want_dx else None
            dw = torch.zeros(v, d, dtype=acc, device=X.device) if want_dw else None
            db = torch.zeros(v, dtype=acc, device=X.device) if want_db else None
            tv = torch.empty(n, dtype=acc, device=X.device)
            loss = torch.zeros((), dtype=acc, device=X.device)
            bounds = [(s, min(s + chunk_size, split)) for s in range(0, split, chunk_size)]
            bounds += [(s, min(s + chunk_size, n)) for s in range(split, n, chunk_size)]
            base_scaled = gates is None
            for s, e in bounds:
                if want_dw and not base_scaled and s >= split:
                    dw.mul_(rg.base[:, None])
                    base_scaled = True
                xc = X[rows[s:e]].to(compute)  # the chunk's rows only: no (N, d) copy of X
                z = F.linear(xc, w, b).to(acc)
                yc = ys[s:e, None]
                target_logit = z.gather(1, yc).squeeze(1)
                if smoothing:  # −Σ_k log p_ik / V = lse_i − mean_k z_ik
                    target_logit = (1.0 - smoothing) * target_logit + smoothing * z.mean(1)
                zmax = z.amax(1, keepdim=True)
                z.sub_(zmax).exp_()
                zsum = z.sum(1, keepdim=True)
                loss += (zmax.squeeze(1) + zsum.squeeze(1).log() - target_logit).sum()
                z.div_(zsum)  # softmax
                if smoothing:
                    z.sub_(smoothing / v)
                z.scatter_add_(1, yc, torch.full_like(target_logit[:, None], smoothing - 1.0))
                z.mul_(scale)  # G_c, the chunk's logit gradient
                zc = z.to(compute)  # G_c for the GEMMs (z itself without autocast): one copy for dX and dW
                if want_dx:
                    dx[rows[s:e]] = torch.mm(zc, w).to(hidden.dtype)
                if want_db:
                    db += z.sum(0)
                if want_dw:
                    if gates is not None:
                        tv[s:e] = z.gather(1, yc).squeeze(1)
                        if s >= split:
                            del zc
                            zc = z.mul_(rg.other).to(compute)
                    addmm_in_(dw, zc.T, xc, compute)
                del z, zc  # free the chunk before the next one is allocated
            if want_dw and gates is not None:
                if not base_scaled:
                    dw.mul_(rg.base[:, None])
                _add_target_rows(dw, rg.target_fix[rows] * tv, X, rows, ys, chunk_size)
            if want_dx:
                dx = dx.reshape(hidden.shape)
        ctx.grads = (dx, None if dw is None else dw.to(weight.dtype), None if db is None else db.to(bias.dtype))
        return loss * scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        if ctx.grads is None:
            raise RuntimeError(
                "agg_cross_entropy: backward can run once per forward (the gradients are computed in forward)"
            )
        out = tuple(None if g is None else g.mul_(grad.to(g.dtype)) for g in ctx.grads)
        ctx.grads = None
        return (*out, None, None, None, None, None, None, None, None)


def _loss_scale(targets: torch.Tensor, ignore_index: int, reduction: str, normalizer) -> float | torch.Tensor:
    """1 / D of `agg_cross_entropy`'s loss."""
    if reduction == "mean":
        if normalizer is not None:
            raise ValueError("normalizer: only used with reduction='sum' (mean divides by the non-ignored targets)")
        return 1.0 / max(int((targets != ignore_index).sum()), 1)
    if reduction == "sum":
        return 1.0 if normalizer is None else 1.0 / normalizer
    raise ValueError(f"reduction={reduction!r}: expected 'mean' or 'sum'")


def agg_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    gates: AGGGates | None = None,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    normalizer: float | torch.Tensor | None = None,
    chunk_size: int | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Cross-entropy of ``F.linear(hidden, weight, bias)`` against `targets`, fused and chunked.

        loss = Σ_{i: y_i ≠ ignore} (logsumexp(z_i) − (1 − ε) z_{i,y_i} − ε mean_k z_ik) / D,   z_i = W h_i + b,

    ε = `label_smoothing` (0: plain cross-entropy; as ``F.cross_entropy(label_smoothing=ε)`` and
    transformers' ``LabelSmoother``: (1 − ε)·CE + ε·mean_k(−log p_ik) per row),

    D = the number of non-ignored targets (``reduction="mean"``, as ``F.cross_entropy``; 0 loss
    and 0 gradients when there is none) or `normalizer` (``reduction="sum"``; 1 if None; pass
    torchtitan's ``global_valid_tokens`` here). Gradients: plain CE for `hidden` and `bias`;
    for `weight` the AGG-gated ``(G ⊙ Γ)ᵀ X`` of `aniso_plugins.agg_linear` (docs/methods.md §1.5),
    or the plain one when `gates` is None (then this is an ordinary fused linear CE).

    Peak extra memory: one logits chunk (`chunk_size` × V, float32; `chunk_size` None: the
    rows of `default_chunk_rows`, at most 256 MiB) and its temporaries beyond the gradients dW
    (V × d, in at least float32) and dX; never N × V, and no (N, d) copy of `hidden`. The
    gradients are computed in the forward (skipped when grad mode is off, e.g. validation), so
    the backward may run once. Under autocast all three GEMMs (logits, dX, dW) take
    autocast-dtype operands, as autograd's; the logits chunk, its gradient and dW are float32,
    and each chunk's dW product (V × d, autocast dtype) is added into dW
    (`aniso_plugins.methods.agg.gates.addmm_in_`). `weight` must be the full (V, d) tensor (under FSDP2 call
    it where the head parameter is unsharded).
    """
    check_inputs(hidden, weight, targets, gates, ignore_index, "agg_cross_entropy")
    if chunk_size is None:
        chunk_size = default_chunk_rows(weight.shape[0])
    elif not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(
            f"chunk_size={chunk_size!r}: expected an integer >= 1 (token rows per chunk) or None (the default)"
        )
    scale = _loss_scale(targets, ignore_index, reduction, normalizer)
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing!r}: expected a number in [0, 1)")
    if gates is not None:
        gates = gates.to(weight.device)
    targets = targets.to(hidden.device)
    dtypes = compute_dtypes(hidden, weight)
    return _FusedAGGCrossEntropy.apply(
        hidden, weight, bias, targets, gates, ignore_index, scale, chunk_size, float(label_smoothing), dtypes,
        torch.is_grad_enabled(),
    )
