"""The rows of an LM-head weight W (V×d) as the row regularizers read them (CosReg, the hinge,
the uniformity of the head rows): where the rows live, their unit vectors and which take part,
blocks of every rank's rows, and the autograd pattern that computes a pairwise gradient in the
forward.

Where the rows live (`split_rows`): a plain tensor (single process, a DDP replica, or the
FSDP2-unsharded weight inside the head's forward) is the whole matrix on every rank; a
``Shard(0)`` DTensor on one mesh dimension (FSDP2, read outside the forward; a tensor-parallel
vocabulary shard, `aniso_plugins.core.model.ModelHandle.head_weight_in_forward`) is this rank's
shard plus the mesh group to reduce over (`aniso_plugins.numerics.distributed.mesh_rows`); a
``Replicate`` DTensor is its local tensor.
Rows are normalized in float32 or wider, with autocast off (`no_autocast`).

Nothing here reads a device value on the host (docs/performance.md §5.8): the
excluded ids, the pairs j = i of a block and the sampled rows' ids are placed from Python
integers and a host-side draw, never by a boolean index, `nonzero` or `.item()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from aniso_plugins.numerics.distributed import chunk_bounds, mesh_rows
from aniso_plugins.numerics.host_copy import to_device
from aniso_plugins.numerics.linalg import all_reduce_sum_shared


class Rows(NamedTuple):
    """This rank's rows of W: ``rows == W[offset : offset + len(rows)]``; `group` is the mesh
    group to reduce over when W is row-sharded, None when `rows` is the whole matrix."""

    rows: torch.Tensor
    offset: int
    total: int
    group: dist.ProcessGroup | None


def split_rows(weight: torch.Tensor, what: str) -> Rows:
    """This rank's rows of `weight` (see the module docstring); `what` names the caller in the
    error for anything but a 2-D tensor."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"{what}: weight must be a 2-D (vocab, hidden) tensor, got {shape}")
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(weight, DTensor):
        if all(isinstance(p, Replicate) for p in weight.placements):
            return Rows(weight.to_local(), 0, weight.shape[0], None)
        if weight.device_mesh.ndim != 1:
            raise NotImplementedError(
                f"{what}: a DTensor weight on the {weight.device_mesh.ndim}-D mesh {weight.device_mesh.mesh_dim_names} "
                f"({weight.placements}); the row terms take a full tensor, a replica or a Shard(0) DTensor on one mesh "
                "dimension (compute them inside the head's forward, where FSDP2 has unsharded the weight)"
            )
        lr = mesh_rows(weight)  # Shard(0) on a 1-D mesh (FSDP2; a tensor-parallel vocabulary shard)
        return Rows(lr.rows, lr.offset, lr.total, weight.device_mesh.get_group())
    return Rows(weight, 0, weight.shape[0], None)


def row_mean(weight: torch.Tensor) -> torch.Tensor:
    """μ = (1/V) Σ_i w_i of the (V, d) `weight`, accumulated in `work_dtype` (float32, or
    float64 for a float64 weight: a per-step sum; a float64 accumulation of a float32 matrix costs
    12× on a CPU), the same on every rank that holds part of it: a plain tensor (one process, a
    DDP replica) in full; a DTensor whose placements are row shards or replicas (FSDP2, HSDP, a
    tensor-parallel vocabulary shard, torchtitan's 2-D layouts) from this rank's partition of its
    rows (`mesh_rows`) summed over every mesh dimension. Raises for a DTensor sharded along d.
    The sum over ranks differs from one process's only in rounding order."""
    from torch.distributed.tensor import DTensor

    if not isinstance(weight, DTensor):
        return weight.sum(0, dtype=work_dtype(weight.dtype)) / weight.shape[0]
    part = mesh_rows(weight)
    total = part.rows.sum(0, dtype=work_dtype(weight.dtype))
    mesh = weight.device_mesh
    for dim in range(mesh.ndim):
        if mesh.size(dim) > 1:
            dist.all_reduce(total, group=mesh.get_group(dim))
    return total / part.total


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of a DTensor (its storage: in-place changes reach the DTensor
    under ``torch.no_grad``), or `tensor` itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or the wider `dtype` (float64)."""
    return torch.promote_types(dtype, torch.float32)


@contextlib.contextmanager
def no_autocast(tensor: torch.Tensor) -> Iterator[None]:
    """Autocast off on `tensor`'s device type (the row math chooses its own precision)."""
    with torch.autocast(device_type=tensor.device.type, enabled=False):
        yield


def global_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`tensor` summed over `group` (unchanged for None: the rows are the whole matrix)."""
    return tensor if group is None else all_reduce_sum_shared(tensor, group)


def check_ids(exclude_ids: Sequence[int], total: int) -> list[int]:
    """The sorted distinct ids of `exclude_ids`; ValueError for one outside [0, total)."""
    ids = sorted({int(i) for i in exclude_ids})
    bad = [i for i in ids if not 0 <= i < total]
    if bad:
        raise ValueError(f"exclude_ids={bad}: token ids must lie in [0, {total}) for a head with {total} rows")
    return ids


def _runs(ids: list[int], offset: int, n: int) -> list[tuple[int, int]]:
    """The sorted `ids` that fall in [offset, offset + n), as local runs [lo, hi) of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if offset <= i < offset + n:
            if runs and runs[-1][1] == i - offset:
                runs[-1] = (runs[-1][0], i - offset + 1)
            else:
                runs.append((i - offset, i - offset + 1))
    return runs


def unit_rows(parts: Rows, exclude_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(û, valid): the local rows normalized to unit length (float32/64), and which of them
    take part. Rows of norm 0 and excluded ids are not valid; their û rows are 0 (no gradient)."""
    x = parts.rows.to(work_dtype(parts.rows.dtype))
    norm = torch.linalg.vector_norm(x, dim=1)
    valid = norm > 0
    for lo, hi in _runs(check_ids(exclude_ids, parts.total), parts.offset, x.shape[0]):
        valid[lo:hi] = False  # a slice fill: no host read, no host-to-device copy
    scale = valid / torch.where(valid, norm, torch.ones_like(norm))  # 1/‖w_i‖, 0 for invalid rows
    return x * scale.unsqueeze(1), valid


def valid_count(valid: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """N, the number of valid rows of the whole matrix (float64, 0-d)."""
    return global_sum(valid.sum(dtype=torch.float64), group)


class GradientInForward(torch.autograd.Function):
    """A scalar whose gradient w.r.t. the first input is computed (and saved) in forward; the
    other inputs get none. Backward scales the saved gradient by the upstream one."""

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        return (grad * grad_out.to(grad.dtype),) + (None,) * (len(ctx.needs_input_grad) - 1)


def column_block(
    flagged: torch.Tensor, start: int, block: int, total: int, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``start : start + block`` of every rank's shard, with their global ids (−1 for
    padding). One all_gather of (block, d + 1) per rank when sharded."""
    piece = flagged[start : start + block]
    if group is None:
        return piece, torch.arange(start, start + len(piece), device=flagged.device)
    world = dist.get_world_size(group)
    padded = flagged.new_zeros(block, flagged.shape[1])
    padded[: len(piece)] = piece
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded.contiguous(), group=group)
    ids = []
    for r in range(world):
        lo, hi = chunk_bounds(total, r, world)
        rid = torch.arange(lo + start, lo + start + block, device=flagged.device)
        ids.append(torch.where(rid < hi, rid, torch.full_like(rid, -1)))
    return torch.cat(gathered), torch.cat(ids)


def own_diagonal(
    offset: int, n: int, start: int, block: int, total: int, group: dist.ProcessGroup | None
) -> list[tuple[int, int, int]]:
    """Where the columns of ``column_block(…, start, block, total, group)`` are the local rows
    ``offset … offset + n − 1`` themselves (the pairs j = i): diagonal segments (first local row,
    first column, length), from the row partition alone (Python integers: no device read)."""
    world = 1 if group is None else dist.get_world_size(group)
    segments = []
    for r in range(world):
        lo, hi = (0, total) if group is None else chunk_bounds(total, r, world)
        first, last = max(lo + start, offset), min(lo + start + block, hi, offset + n)
        if first < last:
            segments.append((first - offset, r * block + first - lo - start, last - first))
    return segments


def mask_diagonal(scores: torch.Tensor, segments: list[tuple[int, int, int]], value: float) -> torch.Tensor:
    """`scores` with ``value`` written on the diagonal `segments` of `own_diagonal` (in place)."""
    for row, col, length in segments:
        scores[row : row + length, col : col + length].diagonal().fill_(value)
    return scores


def gather_sampled(flagged: torch.Tensor, own: torch.Tensor, mine: torch.Tensor, group) -> torch.Tensor:
    """The sampled rows [û | valid] (s × d+1) on every rank: each rank fills those it holds
    (gather at the clamped local index, zeros elsewhere), summed over `group`."""
    if flagged.shape[0] == 0:  # an empty shard holds none
        rows = flagged.new_zeros(len(own), flagged.shape[1])
    else:
        rows = torch.where(mine.unsqueeze(1), flagged[own.clamp(0, flagged.shape[0] - 1)], 0.0)
    if group is not None:
        dist.all_reduce(rows, group=group)  # each sampled row lives on one rank
    return rows


def mask_own(scores: torch.Tensor, own: torch.Tensor, mine: torch.Tensor, value: float) -> torch.Tensor:
    """`scores` (sampled rows × local rows) with ``value`` at (b, own_b) where row b is local: a
    gather and a scatter at the clamped index (rows that are not local write back their value)."""
    if scores.shape[1] == 0:
        return scores
    at = own.clamp(0, scores.shape[1] - 1).unsqueeze(1)
    return scores.scatter_(1, at, torch.where(mine.unsqueeze(1), value, scores.gather(1, at)))


def sample_ids(
    total: int, exclude_ids: Sequence[int], sample: int, generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """S = P[randperm(|P|, generator)[:sample]], P the ids of [0, total) not in `exclude_ids`, in
    increasing order, as int64 on `device`. The j-th id of P is j + #{k : e_k − k ≤ j} (e_k the
    sorted excluded ids), a `searchsorted` on the generator's device: no host read; a CPU draw
    reaches a CUDA `device` through pinned memory and a non-blocking copy."""
    excluded = check_ids(exclude_ids, total)
    where = generator.device if generator is not None else torch.device("cpu")
    picks = torch.randperm(total - len(excluded), generator=generator, device=where)[:sample]
    if excluded:
        below = torch.tensor([e - k for k, e in enumerate(excluded)], dtype=picks.dtype, device=where)
        picks = picks + torch.searchsorted(below, picks, right=True)
    return to_device(picks, device)


__all__ = [
    "GradientInForward",
    "Rows",
    "check_ids",
    "column_block",
    "gather_sampled",
    "global_sum",
    "local_part",
    "mask_diagonal",
    "mask_own",
    "no_autocast",
    "own_diagonal",
    "row_mean",
    "sample_ids",
    "split_rows",
    "unit_rows",
    "valid_count",
    "work_dtype",
]
