"""The options of the example third-party plugin (`third_party_plugin.HeadNormPlugin`), declared
as the built-in features declare theirs. An options module imports only
`aniso_plugins.core.options`: installed through the ``aniso_plugins.options`` entry-point group,
it is loaded while `aniso_plugins.AnisoConfig` is being built."""

from __future__ import annotations

from dataclasses import dataclass

from aniso_plugins.core.errors import ConfigError
from aniso_plugins.core.options import Options


@dataclass(frozen=True)
class HeadNormOptions(Options):
    """The plugin's options: fields of the configuration, checked with it."""

    head_norm_coef: float = 1e-4
    """c of the L2 penalty c·‖W‖²_F on the LM head."""

    def validate(self) -> None:
        if not self.head_norm_coef >= 0:
            raise ConfigError(f"head_norm_coef={self.head_norm_coef!r}: expected a number >= 0")


__all__ = ["HeadNormOptions"]
