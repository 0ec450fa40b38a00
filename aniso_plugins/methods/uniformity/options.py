"""The options of Alignment and uniformity (Wang & Isola 2020) as a loss and a metric, docs/methods.md §13: fields of `aniso_plugins.AnisoConfig`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from aniso_plugins.core.errors import ConfigError
from aniso_plugins.core.options import (
    Options,
    StrList,
    check_choices,
    check_positive_int,
    check_positive_or_none,
    check_range,
    list_field,
)

UNIFORMITY_ON = ("head", "hidden")


@dataclass(frozen=True)
class UniformityOptions(Options):
    """Alignment and uniformity (Wang & Isola 2020) as a loss and a metric."""

    SEQUENCES = {"uniformity_on": str}
    CHOICES = {"uniformity_on": UNIFORMITY_ON}

    uniformity_weight: float = 1.0
    """Weight of the uniformity regularizer (Wang & Isola 2020)."""
    uniformity_t: float = 2.0
    """t of L_uniform = log E exp(−t‖x̂_i − x̂_j‖²) (paper: 2)."""
    uniformity_on: StrList = list_field("head")
    """What the uniformity regularizer spreads: "head" (the LM head rows), "hidden" (the head's
    input of each micro-batch), or both."""
    uniformity_sample: int | None = None
    """Head rows sampled per step for the uniformity regularizer (unbiased pair mean); None:
    exact, blockwise over all rows."""
    uniformity_block: int = 1024
    """Rows per block of the exact uniformity regularizer and metric (memory O(block·V))."""
    uniformity_rows: int = 4096
    """Head rows sampled (identically on every rank) for the "uniformity" metric."""

    def validate(self) -> None:
        check_choices("uniformity_on", self.uniformity_on, UNIFORMITY_ON)
        if not self.uniformity_on:
            raise ConfigError('uniformity_on=(): expected "head", "hidden" or both')
        check_range("uniformity_weight", self.uniformity_weight, 0.0, math.inf, "a number >= 0")
        check_range("uniformity_t", self.uniformity_t, 0.0, math.inf, "a number > 0", low_open=True)
        check_positive_int("uniformity_block", self.uniformity_block)
        check_positive_or_none("uniformity_sample", self.uniformity_sample)
        if self.uniformity_sample is not None:
            check_positive_int("uniformity_sample", self.uniformity_sample, minimum=2)
        check_positive_int("uniformity_rows", self.uniformity_rows, minimum=2)


__all__ = ["UniformityOptions"]
