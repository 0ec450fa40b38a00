"""The options of CosReg, the cosine hinge and spectrum control, docs/methods.md §3-4: fields of `aniso_plugins.AnisoConfig`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from aniso_plugins.core.errors import ConfigError
from aniso_plugins.core.options import (
    IntList,
    Options,
    check_choice,
    check_positive_int,
    check_positive_or_none,
    check_range,
    check_token_ids,
    list_field,
)

HEAD_REGULARIZERS = ("cosreg", "hinge", "spectrum")
"""The methods that share ``reg_weight`` (one of them per configuration)."""
SPECTRUM_PRIORS = ("poly", "exp", "ratio")


@dataclass(frozen=True)
class RegularizerOptions(Options):
    """CosReg."""

    SEQUENCES = {"reg_exclude_ids": int}
    CHOICES = {"spectrum_prior": SPECTRUM_PRIORS}

    reg_weight: float = 1.0
    """γ of CosReg, λ of the hinge, λ of spectrum control."""
    reg_every_microbatch: bool = False
    """Apply a regularizer on every micro-batch (weight / accumulation steps) instead of once
    per optimizer step. The two conventions give the same gradient; this one spreads the cost."""
    reg_exclude_ids: IntList = list_field()
    """Rows left out of the regularizers (e.g. pad and other special ids)."""
    hinge_margin: float = 0.5
    """γ of the hinge: pairs with cos > margin are penalized."""
    hinge_sample: int | None = None
    """Rows sampled per step for the hinge (unbiased estimate); None: exact, blockwise."""
    hinge_block: int = 1024
    """Rows per block of the exact hinge (memory O(block·V))."""
    spectrum_prior: str = "poly"
    """"poly" c1·k^-γ, "exp" c1·exp(-c2·k^γ), or "ratio" (σ1/σd penalty)."""
    spectrum_c1: float | None = None
    """c1 of the prior; None: σ1 of the head at setup."""
    spectrum_c2: float = 0.01
    spectrum_gamma: float = 0.75

    def validate(self) -> None:
        regularizers = [m for m in self.method if m in HEAD_REGULARIZERS]
        if len(regularizers) > 1:
            raise ConfigError(
                f"method={self.method!r}: {' and '.join(regularizers)} both regularize the head rows with the one "
                "weight reg_weight; choose one of them"
            )
        check_range("reg_weight", self.reg_weight, 0.0, math.inf, "a number >= 0")
        check_range("hinge_margin", self.hinge_margin, -1.0, 1.0, "a number in [-1, 1]")
        check_positive_or_none("hinge_sample", self.hinge_sample)
        check_positive_int("hinge_block", self.hinge_block)
        check_choice("spectrum_prior", self.spectrum_prior, SPECTRUM_PRIORS)
        if self.spectrum_c1 is not None:
            check_range("spectrum_c1", self.spectrum_c1, 0.0, math.inf, "a number > 0", low_open=True)
        check_range("spectrum_c2", self.spectrum_c2, 0.0, math.inf, "a number >= 0")
        check_range("spectrum_gamma", self.spectrum_gamma, 0.0, math.inf, "a number > 0", low_open=True)
        check_token_ids("reg_exclude_ids", self.reg_exclude_ids)


__all__ = ["RegularizerOptions"]
