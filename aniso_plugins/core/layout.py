"""`ParallelLayout`: how a run's ranks split the model and the batch, and what the engine has fixed
already, as an adapter reads it from its trainer once (`layout_of` in each adapter) and hands it to
`aniso_plugins.TrainingSession.setup`. The session holds it for the run: its world is in force
around each of the session's calls (`aniso_plugins.numerics.distributed.in_world`), its groups and
meshes reach the plugins through the `ModelHandle` and `StepInfo`, and each plugin may refuse it
(`aniso_refuse_layout`) before anything is changed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class ParallelLayout:
    """One training run's parallel layout. The defaults are one process, or plain data parallelism
    that averages gradients (DDP, FSDP1/2, DeepSpeed ZeRO): every field but those an engine
    changes.

    world: the ranks that stand for the world in aniso_plugins' collectives: under pipeline
        parallelism the ranks of the stage that holds the LM head (no statistic crosses stages);
        None: the default group.
    batch_group: the ranks whose micro-batches are distinct parts of the global batch, over which
        token counts reduce (`StepInfo.batch_group`); None: the world.
    batch_copies: how many ranks hold each micro-batch (the tensor-parallel degree: the ranks of a
        TP group see the same tokens and sum the head input's gradient).
    gradient_weight: the weight of a loss term identical on every rank for the engine's
        data-parallel reduction of gradients: 1 where it averages them (DDP, FSDP, ZeRO), 1/dp
        where it sums them over dp ranks (torchtitan).
    vocab_mesh: the 1-D mesh whose ranks each hold a contiguous ``torch.chunk`` vocabulary shard
        of the head's weight inside its forward (tensor parallelism with loss parallel); None: the
        forward sees all V rows.
    sequence_mesh: the 1-D mesh whose ranks each hold a contiguous ``torch.chunk`` of the sequence
        positions at the blocks' outputs (sequence parallelism); None: a rank's block outputs
        cover its whole micro-batch.
    pipeline_stages: how many pipeline stages split the blocks (1: none).
    pipeline_micro_batches: loss calls per trainer micro-batch (the pipeline schedule's
        micro-batches; 1 without pipeline parallelism): the session counts
        accumulation steps × this many micro-batches per optimizer step.
    backward_runs_twice: whether the trainer runs the backward of one forward twice on the
        retained graph (zero-bubble pipeline schedules: input gradients, then weight gradients).
    parameters_fixed: why the model's parameters can no longer change (the optimizer exists
        already), with the way out; None: a plugin may add parameters at set-up.
    head_bypassed: why the trainer's loss reads the LM head's weight without calling its forward
        (a fused kernel of its own), with the way out; None: the head's forward runs.
    chunked_loss: what makes the trainer's own loss chunked, never the logits (TRL's fused LM
        head, Liger-Kernel's fused linear cross-entropy), which the adapter lets the head answer,
        chunk by chunk, where a plugin acts in the head's forward: the fused loss is then on by
        default (``fused_loss=None``). None: the trainer's loss reads the logits.
    optimizer_flat: why the trainer's optimizer steps flat buffers rather than the model's
        parameters (FSDP1's flat parameters, DeepSpeed's partitions and fp32 master copies), with
        the way out; None: it steps the parameters themselves (one process, DDP, FSDP2's
        DTensors, torchtitan's layouts), whose rows a plugin may change between steps.
    token_outputs: the trainer's chunked loss takes each token's log-probability and these token
        outputs beside it (TRL's ``FusedCausalLMOutput`` fields,
        `aniso_plugins.methods.fused_loss.token_outputs.TOKEN_OUTPUTS`), not a sum."""

    world: dist.ProcessGroup | None = None
    batch_group: dist.ProcessGroup | None = None
    batch_copies: int = 1
    gradient_weight: float = 1.0
    vocab_mesh: DeviceMesh | None = None
    sequence_mesh: DeviceMesh | None = None
    pipeline_stages: int = 1
    pipeline_micro_batches: int = 1
    backward_runs_twice: bool = False
    parameters_fixed: str | None = None
    head_bypassed: str | None = None
    chunked_loss: str | None = None
    optimizer_flat: str | None = None
    token_outputs: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("batch_copies", "pipeline_stages", "pipeline_micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelLayout({name}={value!r}): expected an integer >= 1")
        if not self.gradient_weight > 0:
            raise ValueError(f"ParallelLayout(gradient_weight={self.gradient_weight!r}): expected a number > 0")


__all__ = ["ParallelLayout"]
