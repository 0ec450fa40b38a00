"""Where training is: the step index every hook receives."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepInfo:
    """Position in training, as the adapter reports it.

    step: 1-based index of the optimizer step being computed (completed steps + 1; after
        `aniso_step_end` the trainer's own counter equals it).
    micro_batch: 0-based index of the micro-batch within the step.
    accumulation_steps: micro-batches per optimizer step (gradient accumulation), if known.
    measure: whether metrics will be measured at the end of this step.
    epoch_steps: optimizer steps per epoch, if the adapter knows it (AGG's default window).
    """

    step: int
    micro_batch: int = 0
    accumulation_steps: int = 1
    measure: bool = False
    epoch_steps: int | None = None

    @property
    def last_micro_batch(self) -> bool:
        """True on the micro-batch after which the optimizer steps."""
        return self.micro_batch == self.accumulation_steps - 1
