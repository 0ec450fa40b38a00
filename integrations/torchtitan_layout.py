"""The parallel layout of a torchtitan run as aniso_plugins' session needs it (`layout_of`):
which ranks sum a parameter's gradient, which ranks hold distinct parts of the global batch, the
tensor-parallel mesh of the head's vocabulary shards and of the sequence shards, the pipeline
stage's group; and the layouts the adapter refuses, with the way out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aniso_plugins import SetupError


@dataclass(frozen=True)
class TitanLayout:
    """What the session needs of torchtitan's parallel layout (`layout_of`).

    data_parallel: ranks over which torchtitan sums each parameter's gradient (dp_replicate ×
        dp_shard): a term identical on every rank is added with weight 1 / data_parallel;
    batch_group: the ranks whose micro-batches are distinct parts of the global batch
        (torchtitan's ``loss`` mesh: batch × cp), over which token counts reduce;
    batch_copies: the ranks holding each micro-batch (the TP degree);
    vocab_mesh: the ``tp`` mesh, whose ranks hold vocabulary shards of the head (None: no TP);
    sequence_mesh: the ``tp`` mesh under sequence parallelism, whose ranks hold chunks of the
        positions at the blocks' outputs (None: no TP, or sequence parallelism off);
    stage_group: under pipeline parallelism, the ranks of this rank's pipeline stage, which
        stand for the world in aniso_plugins' collectives (None: no PP);
    pipeline_micro_batches: the loss calls per forward-backward (PP micro-batches; 1 without PP)."""

    data_parallel: int
    batch_group: Any
    batch_copies: int
    vocab_mesh: Any
    sequence_mesh: Any
    stage_group: Any = None
    pipeline_micro_batches: int = 1


def layout_of(parallel_dims, sequence_parallel: bool = True, pipeline_micro_batches: int = 1) -> TitanLayout:
    """The `TitanLayout` of a run, after refusing the layouts the adapter cannot make exact
    (each refusal names the layout and the way out). Collective under pipeline parallelism
    (every rank creates the stage groups)."""
    pd = parallel_dims
    if pd.cp > 1:
        raise SetupError(
            f"context parallelism (cp={pd.cp}) is refused: each rank would hold a slice of every sequence, which "
            "SimCTG's pairs and IntraSim's sentences need whole, and the adapter's exactness is unverified there "
            "(torchtitan 0.3.0 does not run context parallelism on the CPU: SDPA has no context-parallel path on the "
            "default backend); set --parallelism.context_parallel_degree 1"
        )
    if pd.tp > 1 and pd.spmd_backend != "spmd_types":
        raise SetupError(
            f"tensor parallelism with --parallelism.spmd_backend {pd.spmd_backend}: aniso_plugins computes the LM "
            "head's loss on each rank's vocabulary shard as plain tensors, as torchtitan's default 'spmd_types' "
            "backend gives them; use the default backend"
        )
    batch = pd.get_optional_mesh("loss", include_singleton_axes=True)
    tp = pd.get_optional_mesh("tp") if pd.tp > 1 else None
    return TitanLayout(
        data_parallel=pd.dp_replicate * pd.dp_shard,
        batch_group=None if batch is None else batch.get_group(),
        batch_copies=pd.tp,
        vocab_mesh=tp,
        sequence_mesh=tp if sequence_parallel else None,
        stage_group=_stage_group(pd.pp) if pd.pp > 1 else None,
        pipeline_micro_batches=pipeline_micro_batches if pd.pp > 1 else 1,
    )


def _stage_group(pp: int):
    """The ranks of this rank's pipeline stage: torchtitan's meshes put ``pp`` outermost, so
    stage s holds the ranks ``[s·n, (s + 1)·n)``, n = world / pp. Every rank creates every
    stage's group (``new_group`` is collective) and keeps its own."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    n = world // pp
    groups = [dist.new_group(list(range(s * n, (s + 1) * n))) for s in range(pp)]
    return groups[rank // n]


__all__ = ["TitanLayout", "layout_of"]
