"""Spectra through the d×d Gram matrix: the one home of the Gram machinery that the geometry
metrics and spectrum control share (docs/performance.md §5.1-5.3).

σ_i(W) = sqrt(λ_i(WᵀW)); for a row-sharded W, WᵀW = Σ_r W_rᵀW_r, so every rank computes the
Gram of its `local_rows` and one SUM reduction gives the full Gram. Centering uses
WᵀW − n·μμᵀ with μ the mean row, from the same reduced sums. The Grams are float64; the
measurement ones (`gram_stats`, `gram_stats_blocked`) multiply in float64, the training one
(`block_gram`, spectrum control every step) multiplies `GRAM_BLOCK`-row blocks in float32 and
accumulates them in float64, so no float64 V×d copy and no float64 V×d² product is ever made.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist

from aniso_plugins.numerics.distributed import is_distributed, world_group

ROW_BLOCK = 1024
"""Rows processed at a time wherever a (rows × V) intermediate is formed (fused cross-entropy
chunks, exact-hinge blocks, evaluation logits, logit-gradient norms): memory O(ROW_BLOCK · V)."""


GRAM_BLOCK = 4096
"""Rows per float32 block of `block_gram`: each block's WᵀW is summed in float32 over at most this
many rows before it is added to the float64 Gram (relative error ~1e-8 at V = 50k, d = 768)."""


class GramStats(NamedTuple):
    """Σ_i w_i w_iᵀ (d, d), Σ_i w_i (d,), and the row count n (0-d), all float64."""

    gram: torch.Tensor
    row_sum: torch.Tensor
    count: torch.Tensor


def gram_stats(rows: torch.Tensor) -> GramStats:
    """Local sufficient statistics of the rows (differentiable; float64)."""
    x = rows.to(torch.float64)
    return GramStats(x.T @ x, x.sum(0), torch.tensor(float(x.shape[0]), dtype=torch.float64, device=x.device))


def covariance(stats: GramStats, center: bool) -> torch.Tensor:
    """WᵀW (center=False) or (W − 1μᵀ)ᵀ(W − 1μᵀ) = WᵀW − n μμᵀ (center=True)."""
    if not center:
        return stats.gram
    n = stats.count.clamp_min(1.0)
    mean = stats.row_sum / n
    return stats.gram - n * torch.outer(mean, mean)


def singular_values(gram: torch.Tensor) -> torch.Tensor:
    """Singular values of W from G = WᵀW, descending, float64 (negative round-off clamped).
    Differentiable when G is (eigvalsh has a gradient for distinct eigenvalues)."""
    eig = torch.linalg.eigvalsh(gram.to(torch.float64))
    return eig.clamp_min(0.0).sqrt().flip(0)


def gram_stats_blocked(rows: torch.Tensor, block_rows: int = 8192) -> GramStats:
    """`gram_stats` accumulated over blocks of `block_rows` rows, so that the float64 copy
    held at any time is one block, not the whole (V, d) matrix (not differentiable)."""
    if rows.dim() != 2:
        raise ValueError(f"rows must be a 2-D (n, d) tensor, got shape {tuple(rows.shape)}")
    d = rows.shape[1]
    gram = torch.zeros(d, d, dtype=torch.float64, device=rows.device)
    row_sum = torch.zeros(d, dtype=torch.float64, device=rows.device)
    with torch.no_grad():
        for block in rows.detach().split(block_rows):
            x = block.to(torch.float64)
            gram.addmm_(x.T, x)
            row_sum += x.sum(0)
    return GramStats(gram, row_sum, torch.tensor(float(rows.shape[0]), dtype=torch.float64, device=rows.device))


@contextlib.contextmanager
def ieee_float32(device: torch.device) -> Iterator[None]:
    """float32 products on `device` in IEEE float32, not TF32 (a user's
    ``torch.backends.cuda.matmul.fp32_precision = "tf32"`` would round each product to 10 bits)."""
    if device.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "ieee"
    try:
        yield
    finally:
        matmul.fp32_precision = before


def _float_work(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def gram_forward(rows: torch.Tensor, block: int = GRAM_BLOCK) -> torch.Tensor:
    """G = Σ_blocks B_bᵀB_b (d×d, float64): each `block`-row block B_b multiplied in float32 (float64
    for float64 rows; bf16 / fp16 rows upcast one block at a time), the blocks summed in float64."""
    work, d = _float_work(rows.dtype), rows.shape[1]
    gram = torch.zeros(d, d, dtype=torch.float64, device=rows.device)
    with ieee_float32(rows.device), torch.autocast(rows.device.type, enabled=False):
        for piece in rows.split(block):
            x = piece.to(work)
            gram += x.T @ x
    return gram


def gram_backward(rows: torch.Tensor, grad: torch.Tensor, block: int = GRAM_BLOCK) -> torch.Tensor:
    """∂/∂W of ⟨grad, WᵀW⟩: W(grad + gradᵀ), by `block`-row blocks in W's float32 work dtype (the
    d×d factor rounded to it once), in W's dtype."""
    work = _float_work(rows.dtype)
    factor = (grad + grad.T).to(work)
    out = torch.empty_like(rows)
    with ieee_float32(rows.device), torch.autocast(rows.device.type, enabled=False):
        for start in range(0, rows.shape[0], block):
            out[start : start + block] = rows[start : start + block].to(work) @ factor
    return out


class _BlockGram(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, block: int) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.block = block
        return gram_forward(rows, block)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rows,) = ctx.saved_tensors
        return gram_backward(rows, grad, ctx.block), None


def block_gram(rows: torch.Tensor, block: int = GRAM_BLOCK) -> torch.Tensor:
    """WᵀW (d×d, float64), differentiable, without a float64 copy of W (`gram_forward`; gradient
    W(Ḡ + Ḡᵀ) by blocks, `gram_backward`): extra memory one block and two d×d matrices."""
    if rows.dim() != 2:
        raise ValueError(f"rows must be a 2-D (n, d) tensor, got shape {tuple(rows.shape)}")
    return _BlockGram.apply(rows, block)


def eigh_gram(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigen-decomposition of a Gram matrix G = WᵀW (d×d), float64: eigenvalues λ_i = σ_i(W)²
    in descending order and the unit eigenvectors as columns.

    Resolution: eigenvalues at or below d·ε·λ_max (ε of float64; the threshold that
    ``numpy.linalg.matrix_rank`` applies to a d×d matrix) are round-off of the Gram and are set
    to 0, so σ below √(d·ε)·σ_max ≈ 4e-7·σ_max (d = 768) reads as 0 (docs/performance.md §5.1).
    Sign convention: each eigenvector is flipped so that its entry of largest magnitude is
    positive (the first such entry on ties; scikit-learn's ``svd_flip`` rule), which makes the
    result independent of the solver's arbitrary signs.

    A Gram with non-finite entries (NaN / inf weights) has no decomposition: the result is all
    NaN (eigenvalues and eigenvectors), so every metric computed from it reads NaN instead of the
    solver raising; the monitoring plugins report how many entries were non-finite."""
    gram = gram.to(torch.float64)
    finite = torch.isfinite(gram).all()  # decided on the device: no value read back
    lam, vec = torch.linalg.eigh(torch.where(finite, gram, torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)))
    lam, vec = lam.flip(0), vec.flip(1)
    lam = torch.where(lam > gram.shape[0] * torch.finfo(torch.float64).eps * lam[:1].clamp_min(0), lam, 0.0)
    pivot = vec.abs().argmax(0)
    sign = torch.sign(vec.gather(0, pivot[None]).squeeze(0))
    return torch.where(finite, lam, math.nan), torch.where(finite, vec * torch.where(sign == 0, 1.0, sign), math.nan)


class _SumMeanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad / dist.get_world_size(ctx.group), None


def all_reduce_sum_shared(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """SUM across the ranks of `group` (default: the world) for a loss that **every rank
    computes identically and backpropagates once**, such as a regularizer of a row-sharded
    weight (statistics Σ_r s_r of the local shards, then the same scalar R(Σ_r s_r) on every
    rank). Value: Σ_r t_r. Gradient of each rank's input: the mean over ranks of the output
    gradients, i.e. the gradient of the one global loss, so each shard receives exactly its
    rows of the single-process gradient (``torch.distributed.nn.functional.all_reduce`` would
    pass on the sum over ranks, world × that). Identity without torch.distributed or with one
    rank."""
    if group is None and not is_distributed():
        return tensor
    group = world_group() if group is None else group
    if dist.get_world_size(group) == 1:
        return tensor
    return _SumMeanGrad.apply(tensor, group)


__all__ = [
    "GRAM_BLOCK",
    "GramStats",
    "block_gram",
    "gram_backward",
    "gram_forward",
    "ieee_float32",
    "gram_stats",
    "gram_stats_blocked",
    "covariance",
    "singular_values",
    "eigh_gram",
    "all_reduce_sum_shared",
]
