"""The options of AGG (Yu et al. 2022), docs/methods.md §1: fields of `aniso_plugins.AnisoConfig`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from aniso_plugins.core.errors import ConfigError
from aniso_plugins.core.options import (
    IntList,
    Options,
    StrList,
    check_choices,
    check_positive_or_none,
    check_range,
    check_token_ids,
    list_field,
)

AGG_PARTS = ("a", "b", "c")
"""Gradient parts of a rare row that AGG may gate (docs/methods.md §0)."""

DEFAULT_ALPHA = 0.03
"""α when neither ``alpha`` nor ``rare_fraction`` is set: the official language-model recipe's."""


@dataclass(frozen=True)
class AGGOptions(Options):
    """AGG (Yu et al. 2022)."""

    SEQUENCES = {"special_ids": int, "agg_parts": str}
    CHOICES = {"agg_parts": AGG_PARTS}
    STATE_FIELDS = ("alpha", "alpha_tokens", "rare_fraction", "special_ids")
    STATE_DEFAULTS = {"alpha": DEFAULT_ALPHA}  # a saved alpha=None (or 0.03, the old default) is 0.03

    alpha: float | None = None
    """Rare threshold: token k is rare iff a_k < alpha (strict). Paper: 0.03 LM, 0.08 MT.
    None: 0.03 (`DEFAULT_ALPHA`, the paper's semantics), unless ``rare_fraction`` is set."""
    rare_fraction: float | None = None
    """Instead of ``alpha``: the share of the window's target tokens to make rare, in (0, 1). At
    every gate computation α is chosen from the token counter so that the rare group holds the
    share nearest this one (docs/methods.md §1.2); exclusive with ``alpha``. None: ``alpha``."""
    alpha_tokens: int | None = None
    """The target tokens per optimizer update that ``alpha`` refers to (the recipe it was tuned
    on), so that rarity means the same at every batch size: the appearance is then counted per
    ``alpha_tokens`` target tokens, a_k = alpha_tokens · c_k / Σ_j c_j over the window, instead of
    per update of this run (docs/methods.md §1.1). None: per update, the paper's semantics (equal
    to it whenever this run's tokens per update equal alpha_tokens)."""
    window: int | None = None
    """K, optimizer steps the token counter remembers. None: one epoch when the adapter knows it."""
    special_ids: IntList = list_field()
    """Ids with a_k = 1 (never rare), like fairseq's 4 specials."""
    agg_g1: bool = True
    """Ablation: False sets g1 = 1 (no gating for non-rare targets)."""
    agg_g2: bool = True
    """Ablation: False sets g2 = 1 (no gating for rare targets)."""
    agg_static_after: int | None = None
    """Ablation: freeze the rare group (and gates) after this many optimizer steps."""
    agg_freeze_rare: bool = False
    """Ablation: the paper's Freeze experiment, rare rows get no output-side gradient at all."""
    agg_parts: StrList = list_field("b", "c")
    """Gradient parts of a rare row to gate (docs/methods.md §0): (a) own contexts, (b) non-rare
    targets, (c) other rare targets. Default ("b", "c") is the official AGG."""

    def validate(self) -> None:
        check_choices("agg_parts", self.agg_parts, AGG_PARTS)
        if self.alpha is not None:
            check_range("alpha", self.alpha, 0.0, math.inf, "a number > 0", low_open=True)
        if self.rare_fraction is not None:
            check_range("rare_fraction", self.rare_fraction, 0.0, math.nextafter(1.0, 0.0), "a number in (0, 1)",
                        low_open=True)  # fmt: skip
            if self.alpha is not None:
                raise ConfigError(
                    f"alpha={self.alpha!r} and rare_fraction={self.rare_fraction!r}: set one of them. Both choose "
                    "AGG's rare threshold: alpha a fixed one, rare_fraction one chosen from the token counter at every "
                    "step so that about that share of the target tokens is rare"
                )
        check_positive_or_none("window", self.window)
        check_positive_or_none("alpha_tokens", self.alpha_tokens)
        check_positive_or_none("agg_static_after", self.agg_static_after)
        check_token_ids("special_ids", self.special_ids)


__all__ = ["AGGOptions", "DEFAULT_ALPHA"]
