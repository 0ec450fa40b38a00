"""The GEMM and dtype rules shared by the training head's two forwards (`gated_linear`,
`fused_linear_cross_entropy`): input checks, the GEMM / accumulation / logits dtypes under autocast,
and ``out += a @ b`` with bf16 operands into a float32 gradient (docs/performance.md §7.3)."""

from __future__ import annotations

import torch

from aniso_plugins.methods.fused_loss.row_gates import RowGates
from aniso_plugins.numerics.distributed import VocabShard

__all__ = ["PRODUCT_BYTES", "UPCAST_ROWS", "addmm_in_", "check_inputs", "compute_dtypes", "index_targets"]


def _check_weight(weight: torch.Tensor, where: str) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):
        raise TypeError(
            f"{where}: weight is a DTensor with placements {weight.placements}; it needs the full (V, d) "
            "weight: call it where FSDP2 has unsharded the parameter (inside the head module's forward)"
        )
    if weight.dim() != 2:
        raise ValueError(f"{where}: weight must be 2-D (V, d), got shape {tuple(weight.shape)}")


def check_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    gates: RowGates | None,
    ignore_index: int,
    where: str,
    shard: VocabShard | None = None,
) -> None:
    """Shape, dtype and range checks shared by `gated_linear` and `fused_linear_cross_entropy`;
    with `shard`, `weight` holds the rows ``[start, stop)`` of a vocabulary of ``total`` ids. The
    targets' range is checked on their device (``torch._assert_async``: a RuntimeError on the CPU,
    a device-side assert on CUDA), never read back to the host."""
    _check_weight(weight, where)
    rows, d = weight.shape
    v = rows if shard is None else shard.total
    if shard is not None and rows != shard.stop - shard.start:
        raise ValueError(f"{where}: the weight has {rows} rows, its vocabulary shard is ids [{shard.start}, {shard.stop})")
    if hidden.shape[-1] != d:
        raise ValueError(f"{where}: hidden has {hidden.shape[-1]} features, weight expects {d}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"{where}: targets of shape {tuple(targets.shape)} do not match the positions of hidden "
            f"{tuple(hidden.shape[:-1])} (targets must be aligned with the head's output positions)"
        )
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise TypeError(f"{where}: targets must be integer token ids, got {targets.dtype}")
    if gates is not None and gates.vocab_size != v:
        raise ValueError(f"{where}: gates are for {gates.vocab_size} ids, the vocabulary has {v}")
    if targets.numel():  # on the device: no value is read back (docs/performance.md, "What the GPU pays")
        ok = ((targets >= 0) & (targets < v)) | (targets == ignore_index)
        torch._assert_async(ok.all(), f"{where}: targets must be in [0, {v}) or equal ignore_index={ignore_index}")


def index_targets(targets: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`targets` on `device` as gather/index ids: int32 and int64 as they are, any other integer
    dtype (uint8, int16, ...) as int64, as ``F.cross_entropy`` takes them (uint8 would index as a
    mask)."""
    return targets.to(device, None if targets.dtype in (torch.int32, torch.int64) else torch.int64)


def compute_dtypes(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """(GEMM dtype, accumulation dtype, logits dtype) for the head.

    Under autocast the GEMMs run in the autocast dtype and the logits come out in float32
    (so the logit gradient arrives in float32); the weight gradient always accumulates in at
    least float32. Without autocast, and for float64 (which autocast does not cast), everything
    is the weight's dtype, as ``F.linear``."""
    acc = torch.promote_types(weight.dtype, torch.float32)
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and weight.dtype.is_floating_point and weight.dtype != torch.float64:
        return torch.get_autocast_dtype(device), acc, acc  # autocast leaves float64 alone
    return weight.dtype, acc, weight.dtype


UPCAST_ROWS = 512
"""Rows of `out` per block of `addmm_in_`'s CPU path (0.75 + 1.5 MiB of buffers at d = 768; the
block size was chosen by measurement: docs/performance.md §7.3)."""
PRODUCT_BYTES = 64 * 2**20
"""Bytes of one block of `addmm_in_`'s rounded product off the CPU (a V × d product of bf16 would be
1 GB at V = 128256, d = 4096)."""


def addmm_in_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, compute: torch.dtype) -> None:
    """``out += a @ b`` with the GEMM's operands in `compute`, the head's GEMM dtype.

    As autograd computes ``F.linear``'s weight gradient under autocast, and as Liger-Kernel's
    fused linear cross-entropy accumulates dW: a `compute`-dtype GEMM (float32 accumulation inside
    it), its product rounded to `compute` once and added into the float32 `out`; when `compute` is
    `out`'s dtype, ``out.addmm_(a, b)``. A float32 GEMM in a bf16 step would run at the GPU's
    float32 rate, many times slower than plain autograd's (docs/performance.md §7.3).

    Off the CPU the product is one GEMM and one mixed-dtype add per block of rows of `out` whose
    product takes at most `PRODUCT_BYTES`. On the CPU it is computed in blocks of `UPCAST_ROWS`
    rows of `out`, each rounded, converted into a small float32 buffer and added: no `out`-sized
    product (at V = 32768, d = 2048: 128 MiB less), and no mixed-dtype ``add_`` of the whole
    product, which converts through a full-size temporary and is much slower on the CPU than the
    blocks (measurements: docs/performance.md §7.3)."""
    a, b = a.to(compute), b.to(compute)
    if compute == out.dtype:
        out.addmm_(a, b)
    elif out.device.type == "cpu":
        _add_rounded_product_blocked_(out, a, b)
    else:
        _add_rounded_product_in_rows_(out, a, b, max(1, PRODUCT_BYTES // (b.shape[1] * b.element_size())))


def _add_rounded_product_in_rows_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: int) -> None:
    """`addmm_in_` off the CPU: for `rows` rows of `out` at a time, one GEMM in `a`'s dtype (its
    one rounding) and one mixed-dtype add."""
    for i in range(0, out.shape[0], rows):
        out[i : i + rows].add_(torch.mm(a[i : i + rows], b))


def _add_rounded_product_blocked_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """`addmm_in_` on the CPU: blocks of `UPCAST_ROWS` rows of `out`, each a GEMM into a small
    buffer of `a`'s dtype, converted into a small float32 one and added."""
    rows = min(UPCAST_ROWS, out.shape[0])
    part = torch.empty(rows, out.shape[1], dtype=a.dtype)
    stage = torch.empty(rows, out.shape[1], dtype=out.dtype)
    for i in range(0, out.shape[0], UPCAST_ROWS):
        n = min(UPCAST_ROWS, out.shape[0] - i)
        out[i : i + n].add_(stage[:n].copy_(torch.mm(a[i : i + n], b, out=part[:n])))
