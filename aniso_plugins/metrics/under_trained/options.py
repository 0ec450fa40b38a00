"""The options of the under-trained token metric (docs/methods.md §12): fields of `aniso_plugins.AnisoConfig`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from aniso_plugins.core.errors import ConfigError
from aniso_plugins.core.options import IntList, Options, list_field


@dataclass(frozen=True)
class UnderTrainedOptions(Options):
    """Under-trained tokens (Land & Bartolo 2024's unembedding indicator, live)."""

    SEQUENCES = {"under_trained_reference_ids": int}

    under_trained_threshold: float = 0.5
    """A token is suspected under-trained when the cosine of its head row with the mean row of
    the reference tokens (both without the first principal component) is at least this."""
    under_trained_reference_ids: IntList = list_field()
    """Token ids known to be unused (reserved or unreachable tokens); empty: the ids not yet
    seen as a training target."""

    def validate(self) -> None:
        t = self.under_trained_threshold
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or not -1 < t <= 1:
            raise ConfigError(f"under_trained_threshold={t!r}: expected a cosine in (-1, 1], e.g. 0.5")
        bad = [i for i in self.under_trained_reference_ids if i < 0]
        if bad:
            raise ConfigError(f"under_trained_reference_ids={list(self.under_trained_reference_ids)!r}: ids must be >= 0, got {bad}")


__all__ = ["UnderTrainedOptions"]
