"""The options of output-embedding centering, docs/methods.md §18: fields of `aniso_plugins.AnisoConfig`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from aniso_plugins.core.errors import ConfigError
from aniso_plugins.core.options import Options, check_range


@dataclass(frozen=True)
class CenteringOptions(Options):
    """μ-centering and μ-loss (Stollenwerk, Lokrantz & Hertzberg 2026)."""

    mu_loss_weight: float = 1e-4
    """λ of μ-loss, λ·‖μ‖² (the paper's runs: 1e-4, the value z-loss uses)."""

    def validate(self) -> None:
        check_range("mu_loss_weight", self.mu_loss_weight, 0.0, math.inf, "a number >= 0")
        if "mu_centering" in self.method and "mu_loss" in self.method:
            raise ConfigError(
                f"method={self.method!r}: mu_centering sets μ = 0 after every step, which leaves μ-loss no gradient to "
                "give; choose one of them"
            )


__all__ = ["CenteringOptions"]
