"""Where the rows of a parameter live: full tensor, DDP replica, or FSDP2 DTensor shard.

Every statistic over the rows of a (V, d) matrix is computed on `local_rows(...)` and then
summed (or max-ed) across ranks by `aniso_plugins.numerics.reduce`. The partition of rows is the same
for all three cases, so each row is counted exactly once:

- torch.distributed not initialized: all rows, offset 0;
- a plain tensor (or a Replicate DTensor) while torch.distributed is initialized: the tensor is
  a replica (DDP), so rank r takes the r-th chunk of ``torch.chunk(rows, world)``;
- a DTensor sharded on dim 0 (FSDP2 ``fully_shard``): the local shard, which is that same
  chunk (FSDP2 shards with ``torch.chunk`` semantics, trailing shards may be short or empty).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist


class LocalRows(NamedTuple):
    """This rank's rows of a (V, ...) tensor: ``rows == full[offset : offset + len(rows)]``."""

    rows: torch.Tensor
    offset: int
    total: int


def is_distributed() -> bool:
    """True when a default process group exists with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default group; (0, 1) without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def ceil_div(a: int, b: int) -> int:
    """⌈a / b⌉ for integers a >= 0, b >= 1."""
    return -(-a // b)


def chunk_bounds(total: int, index: int, parts: int) -> tuple[int, int]:
    """Row range of chunk `index` of ``torch.chunk(range(total), parts)`` (may be empty)."""
    size = ceil_div(total, parts) if total else 0
    start = min(index * size, total)
    return start, min(start + size, total)


def local_rows(param: torch.Tensor) -> LocalRows:
    """This rank's rows of `param` (full tensor, DDP replica or FSDP2 DTensor), detached or not
    as given. Raises for DTensor layouts other than one mesh dimension with Shard(0) or Replicate."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if isinstance(param, DTensor):
        placements = param.placements
        total = param.shape[0]
        if len(placements) != 1:
            raise NotImplementedError(
                f"local_rows: DTensor on a {len(placements)}-D mesh ({placements}) is not supported; "
                "expected one mesh dimension with Shard(0) (FSDP2) or Replicate"
            )
        placement = placements[0]
        local = param.to_local()
        mesh = param.device_mesh
        if isinstance(placement, Shard) and placement.dim == 0:
            index = mesh.get_local_rank()
            start, _ = chunk_bounds(total, index, mesh.size())
            return LocalRows(local, start, total)
        if isinstance(placement, Replicate):
            start, end = chunk_bounds(total, mesh.get_local_rank(), mesh.size())
            return LocalRows(local[start:end], start, total)
        raise NotImplementedError(f"local_rows: placement {placement} is not supported (Shard(0) or Replicate)")
    total = param.shape[0]
    rank, world = rank_and_world()
    if world == 1:
        return LocalRows(param, 0, total)
    start, end = chunk_bounds(total, rank, world)
    return LocalRows(param[start:end], start, total)


def full_rows(param: torch.Tensor) -> torch.Tensor:
    """The whole (V, d) tensor on this rank: a plain tensor as is, a DTensor all-gathered.

    Collective for DTensors (every rank must call it). For tests and small matrices only:
    metrics and regularizers use `local_rows` plus a reduction instead."""
    from torch.distributed.tensor import DTensor

    return param.full_tensor() if isinstance(param, DTensor) else param


__all__ = ["LocalRows", "ceil_div", "chunk_bounds", "full_rows", "is_distributed", "local_rows", "rank_and_world"]
