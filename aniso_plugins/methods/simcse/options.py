"""The options of Unsupervised SimCSE (Gao, Yao & Chen 2021), docs/methods.md §14: fields of `aniso_plugins.AnisoConfig`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from aniso_plugins.core.errors import ConfigError
from aniso_plugins.core.options import Options, check_choice, check_range

SIMCSE_POOLING = ("cls", "mean")
CAUSAL_LM_METHODS = ("agg", "simctg")
"""The methods for causal-LM training, which SimCSE (sentence encoders) does not combine with."""


@dataclass(frozen=True)
class SimCSEOptions(Options):
    """Unsupervised SimCSE (Gao, Yao & Chen, EMNLP 2021; docs/methods.md §14): each sentence is
    encoded twice with independent dropout masks, and the InfoNCE loss
    ``−log exp(sim(h_i, h_i⁺)/τ) / Σ_j exp(sim(h_i, h_j⁺)/τ)`` (cosine similarity, in-batch
    negatives) pulls the two views together. Not combinable with the causal-LM methods."""

    CHOICES = {"simcse_pooling": SIMCSE_POOLING}

    simcse_weight: float = 1.0
    """Weight of the SimCSE InfoNCE loss (the whole loss when the batch has no labels)."""
    simcse_temperature: float = 0.05
    """τ of SimCSE's InfoNCE (paper: 0.05)."""
    simcse_pooling: str = "cls"
    """Sentence representation: "cls" (first position) or "mean" (mean over non-padding positions)."""

    def validate(self) -> None:
        causal = [m for m in self.method if m in CAUSAL_LM_METHODS]
        if "simcse" in self.method and causal:
            raise ConfigError(
                f"method={self.method!r}: simcse trains sentence encoders (masked LMs, in-batch sentence pairs) "
                f"and {causal[0]} is for causal-LM training; run them separately"
            )
        check_choice("simcse_pooling", self.simcse_pooling, SIMCSE_POOLING)
        check_range("simcse_weight", self.simcse_weight, 0.0, math.inf, "a number >= 0")
        check_range("simcse_temperature", self.simcse_temperature, 0.0, math.inf, "a number > 0", low_open=True)


__all__ = ["SimCSEOptions"]
