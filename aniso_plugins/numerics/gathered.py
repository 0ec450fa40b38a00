"""Full parameters where an engine keeps only a partition of them between steps.

Outside the forward, DeepSpeed ZeRO-3 holds each partitioned parameter as an empty placeholder
(its full shape in ``ds_shape``) and FSDP1 (``FullyShardedDataParallel``) a flat shard of its
unit's parameters; inside a module's forward both engines gather them. What reads the LM head or
the input embedding between steps (metrics, the report at the end of training) does so inside
`gathered`, which gathers the modules' own parameters the way each engine intends, on every rank
(collective: every rank enters it), and partitions them again on exit:

- ZeRO-3: ``deepspeed.zero.GatheredParameters(params, modifier_rank=None)`` on the modules'
  own parameters (read-only: nothing is broadcast back);
- FSDP1: ``FullyShardedDataParallel.summon_full_params(unit, recurse=False, writeback=False)``
  on the innermost FSDP unit that holds each module (the root unit for a decoder's embedding
  and head), found under the engine's outermost module;
- anything else (a full tensor, a DDP replica, FSDP2's DTensors): nothing to gather.

Inside, each rank holds the full parameters, as a DDP replica does, and
`aniso_plugins.numerics.distributed.local_rows` gives every rank its own chunk of the rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn


def is_zero3_partitioned(param: torch.Tensor) -> bool:
    """Whether `param` is a DeepSpeed ZeRO-3 parameter (partitioned outside the forward)."""
    return hasattr(param, "ds_id")


def full_shape(param: torch.Tensor) -> torch.Size:
    """The shape of the whole parameter: ZeRO-3's ``ds_shape`` for a partitioned placeholder,
    else its own (a DTensor's is the global one)."""
    shape = getattr(param, "ds_shape", None)
    return torch.Size(shape) if is_zero3_partitioned(param) and shape is not None else param.shape


def fsdp1_units(root: nn.Module | None) -> list[nn.Module]:
    """The ``FullyShardedDataParallel`` (FSDP1) units under `root` (itself included), or []."""
    if root is None:
        return []
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel.fsdp_modules(root)


def _owning_unit(units: Sequence[nn.Module], module: nn.Module) -> nn.Module | None:
    """The innermost of `units` that holds `module` (its parameters are in that unit's flat
    parameter), or None."""
    holding = [unit for unit in units if any(m is module for m in unit.modules())]
    return min(holding, key=lambda unit: sum(1 for _ in unit.modules()), default=None)


@contextlib.contextmanager
def gathered(modules: Sequence[nn.Module | None], engine_root: nn.Module | None = None) -> Iterator[None]:
    """While inside, the own parameters of each of `modules` (None entries skipped) are full
    tensors on every rank; `engine_root`: the engine's outermost module (FSDP1's root unit),
    under which FSDP1 units are looked for. Collective under ZeRO-3 and FSDP1: every rank must
    enter it with the same modules. Read-only: changes made inside are not written back."""
    present = [m for m in modules if m is not None]
    with contextlib.ExitStack() as stack:
        params = list({id(p): p for m in present for p in m.parameters(recurse=False)}.values())
        zero = [p for p in params if is_zero3_partitioned(p)]
        if zero:
            import deepspeed

            stack.enter_context(deepspeed.zero.GatheredParameters(zero, modifier_rank=None))
        units = fsdp1_units(engine_root)
        if units:
            from torch.distributed.fsdp import FullyShardedDataParallel

            owners = {id(u): u for m in present if (u := _owning_unit(units, m)) is not None}
            for unit in sorted(owners.values(), key=lambda u: units.index(u)):  # the same order on every rank
                stack.enter_context(FullyShardedDataParallel.summon_full_params(unit, recurse=False, writeback=False))
        yield


__all__ = ["fsdp1_units", "full_shape", "gathered", "is_zero3_partitioned"]
