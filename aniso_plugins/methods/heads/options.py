"""The options of The low-rank head (seed 001 §3.1), docs/methods.md §10: fields of `aniso_plugins.AnisoConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from aniso_plugins.core.errors import ConfigError
from aniso_plugins.core.options import Options, check_choice, check_positive_or_none

LOWRANK_INITS = ("svd", "random")


@dataclass(frozen=True)
class HeadOptions(Options):
    """The low-rank head (seed 001 §3.1)."""

    STATE_FIELDS = ("lowrank_rank",)
    CHOICES = {"lowrank_init": LOWRANK_INITS}

    lowrank_rank: int | None = None
    """Rank r < d of the low-rank head W = A·B."""
    lowrank_init: str = "svd"
    """"svd" (truncated SVD of the current head) or "random"."""

    def validate(self) -> None:
        check_choice("lowrank_init", self.lowrank_init, LOWRANK_INITS)
        check_positive_or_none("lowrank_rank", self.lowrank_rank)
        if self.head == "lowrank" and self.lowrank_rank is None:
            raise ConfigError("lowrank_rank=None: head='lowrank' needs an integer rank >= 1 (and < d)")


__all__ = ["HeadOptions"]
