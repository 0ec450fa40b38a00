"""The options of Frequency groups (the AGG paper's rare / medium / frequent tokens), docs/methods.md §1.8: fields of `aniso_plugins.AnisoConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from aniso_plugins.core.errors import ConfigError
from aniso_plugins.core.options import FloatList, Options, check_choice, list_field

GROUP_TOKENS = ("vocabulary", "seen")
"""The ids the group shares are of (``group_tokens``)."""


@dataclass(frozen=True)
class FrequencyOptions(Options):
    """Frequency groups (the AGG paper's rare / medium / frequent tokens)."""

    SEQUENCES = {"group_fractions": float}
    CHOICES = {"group_tokens": GROUP_TOKENS}

    group_fractions: FloatList = list_field(0.2, 0.5, 0.3)
    """Rare / medium / frequent shares of the vocabulary for frequency groups (AGG seed)."""

    group_tokens: str = "vocabulary"
    """Which ids the shares are of: "vocabulary" (all V ids, the AGG paper) or "seen" (the ids
    counted at least once; the others are in no group). The offline report uses "seen"."""

    def validate(self) -> None:
        check_choice("group_tokens", self.group_tokens, GROUP_TOKENS)
        fr = self.group_fractions
        if len(fr) != 3 or any(not (0 < f < 1) for f in fr) or abs(sum(fr) - 1) > 1e-6:
            raise ConfigError(
                f"group_fractions={fr!r}: expected three shares in (0, 1) summing to 1, "
                "e.g. (0.2, 0.5, 0.3) for rare / medium / frequent"
            )


__all__ = ["FrequencyOptions"]
