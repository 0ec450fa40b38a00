"""The options of Hidden-state anisotropy per layer, docs/methods.md §7-8: fields of `aniso_plugins.AnisoConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from aniso_plugins.core.options import Options, check_positive_int


@dataclass(frozen=True)
class HiddenOptions(Options):
    """Hidden-state anisotropy per layer."""


    hidden_samples: int = 256
    """Token representations sampled per layer and measurement for hidden-state anisotropy."""

    def validate(self) -> None:
        check_positive_int("hidden_samples", self.hidden_samples, minimum=2)


__all__ = ["HiddenOptions"]
