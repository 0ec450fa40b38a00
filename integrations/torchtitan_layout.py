"""The parallel layout of a torchtitan run as aniso_plugins' session holds it (`layout_of`):
which ranks sum a parameter's gradient, which hold distinct parts of the global batch, the
tensor-parallel mesh of the head's vocabulary shards and of the sequence shards, the pipeline
stage's group and schedule; and the layouts the adapter refuses, with the way out."""

from __future__ import annotations

from aniso_plugins import ParallelLayout, SetupError

PARAMETERS_FIXED = (
    "the torchtitan adapter keeps the model's head (torchtitan builds the model and its optimizer from its config; "
    "untie with the model config's enable_weight_tying=False)"
)


def layout_of(trainer) -> ParallelLayout:
    """The `ParallelLayout` of a built torchtitan ``Trainer``, after refusing the layouts the
    adapter cannot make exact (each refusal names the layout and the way out): torchtitan sums
    gradients over dp_replicate × dp_shard ranks (``gradient_weight`` 1/dp); its ``loss`` mesh
    (batch × cp) holds distinct parts of the batch; each micro-batch has ``tp`` copies; the
    ``tp`` mesh holds the head's vocabulary shards (and the positions, with sequence
    parallelism); under pipeline parallelism the world is this rank's stage. Collective under
    pipeline parallelism (every rank creates the stage groups)."""
    pd = trainer.parallel_dims
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
    pp = pd.pp > 1
    return ParallelLayout(
        world=_stage_group(pd.pp) if pp else None,
        batch_group=None if batch is None else batch.get_group(),
        batch_copies=pd.tp,
        gradient_weight=1.0 / (pd.dp_replicate * pd.dp_shard),
        vocab_mesh=tp,
        sequence_mesh=tp if trainer.config.parallelism.enable_sequence_parallel else None,
        pipeline_stages=pd.pp,
        pipeline_micro_batches=getattr(trainer, "num_pipeline_parallel_microbatches", 1) if pp else 1,
        backward_runs_twice=_splits_backward(getattr(trainer, "pp_schedule", None)),
        parameters_fixed=PARAMETERS_FIXED,
    )


def _splits_backward(schedule) -> bool:
    """Whether a pipeline schedule runs separate input- and weight-gradient backwards (zero bubble)."""
    from torch.distributed.pipelining.schedules import _ComputationType

    order = getattr(schedule, "pipeline_order", None) or {}
    return any(action is not None and action.computation_type == _ComputationType.BACKWARD_INPUT
               for actions in order.values() for action in actions)


def _stage_group(pp: int):
    """The ranks of this rank's pipeline stage: torchtitan's meshes put ``pp`` outermost, so
    stage s holds the ranks ``[s·n, (s + 1)·n)``, n = world / pp. Every rank creates every
    stage's group (``new_group`` is collective) and keeps its own."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    n = world // pp
    groups = [dist.new_group(list(range(s * n, (s + 1) * n))) for s in range(pp)]
    return groups[rank // n]


__all__ = ["layout_of"]
