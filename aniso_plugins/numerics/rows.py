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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from aniso_plugins.numerics.distributed import chunk_bounds, mesh_rows
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


def unit_rows(parts: Rows, exclude_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(û, valid): the local rows normalized to unit length (float32/64), and which of them
    take part. Rows of norm 0 and excluded ids are not valid; their û rows are 0 (no gradient)."""
    x = parts.rows.to(work_dtype(parts.rows.dtype))
    norm = torch.linalg.vector_norm(x, dim=1)
    valid = norm > 0
    ids = check_ids(exclude_ids, parts.total)
    if ids:
        local = torch.tensor(ids, dtype=torch.long, device=x.device) - parts.offset
        local = local[(local >= 0) & (local < x.shape[0])]
        valid[local] = False
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


__all__ = ["GradientInForward", "Rows", "check_ids", "column_block", "global_sum", "no_autocast", "split_rows", "unit_rows", "valid_count", "work_dtype"]
