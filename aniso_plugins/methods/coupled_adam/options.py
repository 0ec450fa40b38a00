"""The options of Coupled Adam, docs/methods.md §17: fields of `aniso_plugins.AnisoConfig`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from aniso_plugins.core.options import Options, check_range


@dataclass(frozen=True)
class CoupledAdamOptions(Options):
    """Coupled Adam (Stollenwerk & Stollenwerk, ACL 2025)."""

    coupled_adam_decay: bool = False
    """Apply the optimizer group's weight decay to the output embedding too. Off, as in the
    paper's runs (their ``embdecay=False``): the embedding is not decayed."""
    coupled_adam_scale: float = 1.0
    """s in v̄ = s · mean_i v[i, :] (the official code's ``avg_scale``; 1 in the paper's main runs)."""

    def validate(self) -> None:
        check_range("coupled_adam_scale", self.coupled_adam_scale, 0.0, math.inf, "a number > 0", low_open=True)


__all__ = ["CoupledAdamOptions"]
