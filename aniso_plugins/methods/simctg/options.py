"""The options of SimCTG (Su et al. 2022), docs/methods.md §12: fields of `aniso_plugins.AnisoConfig`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from aniso_plugins.core.options import Options, check_positive_int, check_range


@dataclass(frozen=True)
class SimCTGOptions(Options):
    """SimCTG (Su et al. 2022)."""


    simctg_weight: float = 1.0
    """Weight of the SimCTG token contrastive loss (Su et al. 2022: 1, added to the MLE loss)."""
    simctg_margin: float = 0.5
    """ρ of SimCTG: pairs of positions with s(h_i,h_i) − s(h_i,h_j) < ρ are penalized (paper: 0.5)."""
    simctg_block: int = 512
    """Query positions per block of the SimCTG loss (memory O(B·T·block))."""

    def validate(self) -> None:
        check_range("simctg_weight", self.simctg_weight, 0.0, math.inf, "a number >= 0")
        check_range("simctg_margin", self.simctg_margin, 0.0, 2.0, "a number in [0, 2] (cosines differ by at most 2)")
        check_positive_int("simctg_block", self.simctg_block)


__all__ = ["SimCTGOptions"]
