"""Reducible statistics: what metric plugins return, and the one place they cross ranks.

A plugin never calls a collective itself. It returns named `Stat`s computed on its local rows
or its local micro-batches; `reduce_stats` combines all of them at once with one flat
collective per (dtype, op, scope): all_reduce SUM / MAX / MIN, or all_gather for LSE (the
log-sum-exp of per-rank log-sum-exps, as Cut Cross-Entropy's ``vp_reduce_lse``).
Without torch.distributed the statistics pass through unchanged.

Two scopes: a statistic of a parameter's rows (``over="world"``, the rows partitioned over the
world by `aniso_plugins.local_rows`) reduces over the world; a statistic of the micro-batches
(``over="batch"``: targets, hidden states, logits) reduces over the batch group, the ranks whose
micro-batches are distinct parts of the global batch. The two differ where ranks hold copies
of one micro-batch (tensor parallelism: every rank of a TP group sees the same tokens).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal, NamedTuple

import torch
import torch.distributed as dist

from aniso_plugins.numerics.distributed import is_distributed, world_group

ReduceOp = Literal["sum", "max", "min", "lse"]


Scope = Literal["world", "batch"]


class Stat(NamedTuple):
    """A tensor, how to combine it across ranks, and over which ranks.

    op: sum: sums, counts, Gram matrices; max/min: extrema, unions of 0/1 masks (max);
    lse: per-rank log-sum-exps, combined as ``log Σ_r exp(x_r)`` elementwise.
    over: "world" for statistics of a parameter's rows, "batch" for statistics of the
    micro-batches (see the module docstring)."""

    value: torch.Tensor
    op: ReduceOp = "sum"
    over: Scope = "world"


def _dist_op(op: str):
    return {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]


def reduce_stats(
    stats: Mapping[str, Stat],
    group: dist.ProcessGroup | None = None,
    batch_group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """Combine `stats` across ranks: ``over="world"`` ones over `group` (default: the world,
    `aniso_plugins.numerics.distributed.world_group`),
    ``over="batch"`` ones over `batch_group` (default: `group`).

    Every rank must call this with the same names, shapes, dtypes, ops and scopes, in any
    order. Tensors are detached; each (dtype, op, scope) class costs one collective on one flat
    buffer. Returns name -> reduced tensor (same shape and dtype as given)."""
    for name, stat in stats.items():
        if not isinstance(stat, Stat):
            raise TypeError(f"statistic {name!r} must be a Stat(value, op), got {type(stat).__name__}")
        if stat.op not in ("sum", "max", "min", "lse"):
            raise ValueError(f"statistic {name!r}: op must be sum, max, min or lse, got {stat.op!r}")
        if stat.over not in ("world", "batch"):
            raise ValueError(f"statistic {name!r}: over must be 'world' or 'batch', got {stat.over!r}")
    if not is_distributed():
        return {name: stat.value.detach() for name, stat in stats.items()}
    group = world_group() if group is None else group

    out: dict[str, torch.Tensor] = {}
    classes: dict[tuple[torch.dtype, torch.device, str, str], list[str]] = {}
    for name in sorted(stats):
        v = stats[name].value
        classes.setdefault((v.dtype, v.device, stats[name].op, stats[name].over), []).append(name)
    for (dtype, device, op, over), names in sorted(classes.items(), key=lambda kv: tuple(map(str, kv[0]))):
        flat = torch.cat([stats[n].value.detach().reshape(-1) for n in names]).to(dtype)
        flat = _reduce_flat(flat, op, batch_group if over == "batch" and batch_group is not None else group)
        i = 0
        for n in names:
            v = stats[n].value
            out[n] = flat[i : i + v.numel()].reshape(v.shape)
            i += v.numel()
    return out


def _reduce_flat(flat: torch.Tensor, op: str, group: dist.ProcessGroup | None) -> torch.Tensor:
    """One collective on one flat buffer (`reduce_stats`)."""
    if op == "lse":
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, flat, group=group)
        return torch.logsumexp(torch.stack(gathered), dim=0)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
        dist.all_reduce(flat, op=_dist_op(op), group=group)
        return flat.bool()
    dist.all_reduce(flat, op=_dist_op(op), group=group)
    return flat


def batch_scope(stats: Mapping[str, Stat]) -> dict[str, Stat]:
    """`stats` as statistics of the micro-batches (``over="batch"``)."""
    return {name: stat._replace(over="batch") for name, stat in stats.items()}


def combine_stats(acc: dict[str, Stat], part: Mapping[str, Stat]) -> None:
    """Sum (or log-sum-exp, max, min) `part` into `acc` in place, as `reduce_stats` combines
    ranks: the statistics of two row blocks give those of their union."""
    for k, s in part.items():
        if k not in acc:
            acc[k] = s._replace(value=s.value.clone())
        elif s.op == "sum":
            acc[k] = s._replace(value=acc[k].value + s.value)
        elif s.op == "lse":
            acc[k] = s._replace(value=torch.logaddexp(acc[k].value, s.value))
        elif s.op == "max":
            acc[k] = s._replace(value=torch.maximum(acc[k].value, s.value))
        else:
            acc[k] = s._replace(value=torch.minimum(acc[k].value, s.value))


def sum_over_blocks(parts: Iterable[Mapping[str, Stat]]) -> dict[str, Stat]:
    """The statistics of all blocks together: `combine_stats` of `parts`, in order."""
    acc: dict[str, Stat] = {}
    for part in parts:
        combine_stats(acc, part)
    return acc


def stat_values(stats: Mapping[str, Stat]) -> dict[str, torch.Tensor]:
    """The tensors of statistics that need no further reduction (one process, blocks summed)."""
    return {k: s.value for k, s in stats.items()}


__all__ = ["ReduceOp", "Scope", "Stat", "batch_scope", "combine_stats", "reduce_stats", "stat_values", "sum_over_blocks"]
