"""Where the rows of a parameter live: full tensor, DDP replica, or a DTensor of any row layout.

Every statistic over the rows of a (V, d) matrix is computed on `local_rows(...)` and then
summed (or max-ed) across the ranks of the world by `aniso_plugins.numerics.reduce`. The rows
are partitioned over the world, so each row is counted exactly once:

- torch.distributed not initialized: all rows, offset 0;
- a plain tensor while torch.distributed is initialized: the tensor is a replica (DDP), so
  rank r takes the r-th chunk of ``torch.chunk(rows, world)``;
- a DTensor whose placements shard dim 0 or replicate, on a mesh of any number of dimensions
  spanning the world (FSDP2 ``Shard(0)``; HSDP ``(Replicate(), Shard(0))``; tensor parallel
  ``(_StridedShard(0), Shard(0))`` on (dp_shard, tp); a ``Replicate`` DTensor): this rank's
  shard, split further into ``torch.chunk`` pieces among the ranks that hold the same shard
  (the coordinates of the replicated mesh dimensions). The shards use ``torch.chunk``
  semantics: trailing ones may be short or empty.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import NamedTuple

import torch
import torch.distributed as dist


class LocalRows(NamedTuple):
    """This rank's rows of a (V, ...) tensor: ``rows == full[offset : offset + len(rows)]``."""

    rows: torch.Tensor
    offset: int
    total: int


_WORLD: ContextVar[dist.ProcessGroup | None] = ContextVar("aniso_plugins_world", default=None)


@contextlib.contextmanager
def in_world(group: dist.ProcessGroup | None) -> Iterator[None]:
    """While inside, `group` stands for the world in aniso_plugins' collectives (the ranks of the
    head's pipeline stage under pipeline parallelism: no statistic crosses stages); None: the
    default group. The session enters its layout's world around each of its calls, so that
    nothing outlives a call and two sessions in one process keep their own worlds."""
    token = _WORLD.set(group)
    try:
        yield
    finally:
        _WORLD.reset(token)


def world_group() -> dist.ProcessGroup | None:
    """The group of the innermost `in_world` (None: the default group)."""
    return _WORLD.get()


def is_distributed() -> bool:
    """True when the world (`world_group`) has more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(world_group()) > 1


def rank_and_world() -> tuple[int, int]:
    """(rank, size) in the world (`world_group`); (0, 1) without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    group = world_group()
    return dist.get_rank(group), dist.get_world_size(group)


def ceil_div(a: int, b: int) -> int:
    """⌈a / b⌉ for integers a >= 0, b >= 1."""
    return -(-a // b)


def chunk_bounds(total: int, index: int, parts: int) -> tuple[int, int]:
    """Row range of chunk `index` of ``torch.chunk(range(total), parts)`` (may be empty)."""
    size = ceil_div(total, parts) if total else 0
    start = min(index * size, total)
    return start, min(start + size, total)


def local_rows(param: torch.Tensor) -> LocalRows:
    """This rank's rows of `param` (full tensor, DDP replica or DTensor; see the module
    docstring), detached or not as given. Raises for a DTensor that shards another dimension,
    is partial, or lives on a mesh that does not span the world."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return _dtensor_rows(param)
    total = param.shape[0]
    rank, world = rank_and_world()
    if world == 1:
        return LocalRows(param, 0, total)
    start, end = chunk_bounds(total, rank, world)
    return LocalRows(param[start:end], start, total)


def mesh_rows(param) -> LocalRows:
    """The rows of the DTensor `param` that this rank holds, partitioned over the ranks of its
    own mesh: its local shard's rows in the global tensor (``Shard(0)`` in any strided form),
    split in ``torch.chunk`` pieces among the ranks that hold the same shard (the coordinates
    of its ``Replicate`` mesh dimensions). Raises for another placement (a shard of another
    dimension, a partial tensor: no rows of its own on a rank)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    placements, mesh, total = param.placements, param.device_mesh, param.shape[0]
    for placement in placements:
        rows = (placement.is_shard() or isinstance(placement, _StridedShard)) and placement.dim == 0
        if not (placement.is_replicate() or rows):
            raise NotImplementedError(
                f"local_rows: DTensor placements {placements} on mesh {mesh.mesh_dim_names}: only Shard(0) (any "
                "strided form) and Replicate are row layouts; a parameter sharded on another dimension or "
                "partial has no rows of its own on a rank"
            )
    local = param.to_local()
    _, offset = compute_local_shape_and_global_offset(param.shape, mesh, placements)
    replicas, index = 1, 0
    coordinate = mesh.get_coordinate()
    for dim, placement in enumerate(placements):
        if placement.is_replicate():
            index = index * mesh.size(dim) + coordinate[dim]
            replicas *= mesh.size(dim)
    start, end = chunk_bounds(local.shape[0], index, replicas)
    return LocalRows(local[start:end], offset[0] + start, total)


def _dtensor_rows(param) -> LocalRows:
    """`local_rows` of a DTensor: `mesh_rows`, once its mesh is known to span the world."""
    _, world = rank_and_world()
    if param.device_mesh.size() != world:
        raise NotImplementedError(
            f"local_rows: the DTensor's mesh {param.device_mesh.mesh_dim_names} has {param.device_mesh.size()} "
            f"ranks, the world {world}: its rows can be partitioned over the world only when its mesh spans it"
        )
    return mesh_rows(param)


def vocab_shard_rows(mesh, total: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of a (total, ...) tensor that this rank holds when the 1-D `mesh`
    splits it into ``torch.chunk`` pieces by rank (tensor parallelism's vocabulary shards, as
    torchtitan's loss-parallel cross-entropy assumes them)."""
    return chunk_bounds(total, mesh.get_local_rank(), mesh.size())


class VocabShard(NamedTuple):
    """This rank's vocabulary ids ``[start, stop)`` of `total`, the rows of the LM head's weight
    it holds, and the group of ranks that hold the other shards (tensor parallelism)."""

    start: int
    stop: int
    total: int
    group: dist.ProcessGroup

    @classmethod
    def of(cls, mesh, total: int) -> VocabShard:
        """The shard of `vocab_shard_rows` on the 1-D `mesh`."""
        return cls(*vocab_shard_rows(mesh, total), total, mesh.get_group())

    def owned(self, ids: torch.Tensor) -> torch.Tensor:
        """Which of the global `ids` lie in this shard (bool, shaped like `ids`)."""
        return (ids >= self.start) & (ids < self.stop)


def full_rows(param: torch.Tensor) -> torch.Tensor:
    """The whole (V, d) tensor on this rank: a plain tensor as is, a DTensor all-gathered.

    Collective for DTensors (every rank must call it). For tests and small matrices only:
    metrics and regularizers use `local_rows` plus a reduction instead."""
    from torch.distributed.tensor import DTensor

    return param.full_tensor() if isinstance(param, DTensor) else param


__all__ = [
    "LocalRows", "VocabShard", "ceil_div", "chunk_bounds", "full_rows", "is_distributed", "local_rows", "mesh_rows",
    "in_world", "rank_and_world", "vocab_shard_rows", "world_group",
]
