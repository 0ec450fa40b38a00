"""Where training is: what the adapter tells the plugins about the run and about each step."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from aniso_plugins.numerics.distributed import ceil_div, rank_and_world


@dataclass(frozen=True)
class RunInfo:
    """What the adapter knows when training begins (`aniso_begin_training`).

    epoch_steps: optimizer steps per epoch, if the trainer knows it (AGG's default window);
        None for streaming data.
    start_step: optimizer steps already done (0 for a fresh run, the checkpoint's step when
        resuming).
    accumulation_steps: micro-batches per optimizer step (gradient accumulation).
    label_smoothing: the trainer's label smoothing ε of the token loss (the fused loss
        reproduces it; 0 when the trainer has none).
    optimizers: the trainer's optimizers, once built (Coupled Adam hooks the one holding the
        head's weight); empty where the adapter has none to give.
    """

    epoch_steps: int | None = None
    start_step: int = 0
    accumulation_steps: int = 1
    label_smoothing: float = 0.0
    optimizers: tuple[torch.optim.Optimizer, ...] = ()


@dataclass(frozen=True, eq=False)
class StepInfo:
    """Position in training, as the adapter reports it.

    step: 1-based index of the optimizer step being computed (completed steps + 1; after
        `aniso_step_end` the trainer's own counter equals it).
    micro_batch: 0-based index of the micro-batch within the step.
    accumulation_steps: micro-batches in this optimizer step (gradient accumulation).
    measure: whether metrics will be measured at the end of this step.
    head_calls: how many times the LM head runs on this micro-batch: once per equal chunk of
        the targets' last dimension, in order (torchtitan's chunked loss; 1 elsewhere).
    loss_normalizer: only where the head computes the loss (`TrainingSession.head_computes_loss`):
        the divisor of this micro-batch's summed token loss (torchtitan's global valid tokens),
        or None for the sum (the adapter divides, as the HF adapter does).
    input_ids / attention_mask: the token ids and padding mask (1 = token, 0 = padding) at the
        LM head's positions (an encoder-decoder's decoder inputs), shaped like the targets,
        when the adapter's batches carry them (HF and Lightning dict batches); None otherwise
        (torchtitan passes neither).
    sequence_ids: for a packed micro-batch (several examples per row), the example each
        position belongs to within its row (int64, shaped like the targets;
        `aniso_plugins.core.targets.sequence_ids`); None when each row is one example. Terms and
        metrics that pair positions of one example compare these.
    batch_group: the ranks whose micro-batches are distinct parts of the global batch, over
        which sums of the batch (token counts, activation statistics: ``Stat(over="batch")``)
        reduce; None: the world (`aniso_plugins.numerics.distributed.world_group`). It differs
        from the world where ranks hold copies of one micro-batch (tensor parallelism).
    """

    step: int
    micro_batch: int = 0
    accumulation_steps: int = 1
    measure: bool = False
    head_calls: int = 1
    loss_normalizer: torch.Tensor | None = None
    input_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    sequence_ids: torch.Tensor | None = None
    batch_group: dist.ProcessGroup | None = None

    @property
    def batch_ranks(self) -> int:
        """How many ranks hold distinct parts of the global batch (the size of `batch_group`)."""
        if self.batch_group is None:
            return rank_and_world()[1]
        return dist.get_world_size(self.batch_group)

    @property
    def last_micro_batch(self) -> bool:
        """True on the micro-batch after which the optimizer steps."""
        return self.micro_batch == self.accumulation_steps - 1

    def generator(self) -> torch.Generator:
        """A CPU generator seeded from (step, micro-batch): the same draws on every rank and on
        a resumed run (the sampled regularizers' rows)."""
        return torch.Generator().manual_seed(self.step * 65_536 + self.micro_batch)


def optimizer_steps_per_epoch(batches: object, accumulation_steps: int) -> int | None:
    """Optimizer steps in one epoch of `batches` micro-batches (a number, or a sized object such
    as a DataLoader) under `accumulation_steps`; None when the length is unknown or infinite."""
    try:
        n = batches if isinstance(batches, (int, float)) else len(batches)  # type: ignore[arg-type]
    except TypeError:  # an iterable dataset without a length
        return None
    if n is None or n != n or n == float("inf"):
        return None
    return ceil_div(int(n), max(int(accumulation_steps), 1))


class TargetChunks:
    """A micro-batch's targets handed out one chunk per call of the LM head, in order.

    `targets` is split into `chunks` equal pieces along its last dimension (the sequence),
    exactly as torchtitan's chunked loss splits the hidden states; with ``chunks=1`` the one
    piece is the whole tensor. `take` returns the next piece, or None when all were used."""

    def __init__(self, targets: torch.Tensor, chunks: int = 1) -> None:
        if chunks < 1:
            raise ValueError(f"chunks={chunks!r}: expected an integer >= 1")
        self._pieces = list(targets.chunk(chunks, dim=-1)) if chunks > 1 else [targets]
        self._next = 0

    def take(self, shape: tuple[int, ...] | torch.Size | None = None) -> torch.Tensor | None:
        """The next piece; None when all were used, or when `shape` (a head output's leading
        shape) is given and is not the next piece's (that call is not for these targets)."""
        if self._next >= len(self._pieces):
            return None
        piece = self._pieces[self._next]
        if shape is not None and tuple(shape) != tuple(piece.shape):
            return None
        self._next += 1
        return piece

    @property
    def exhausted(self) -> bool:
        return self._next >= len(self._pieces)


__all__ = ["RunInfo", "StepInfo", "TargetChunks", "optimizer_steps_per_epoch"]
