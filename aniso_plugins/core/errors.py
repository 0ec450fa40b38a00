"""The errors aniso_plugins raises, one hierarchy under `AnisoError`.

Each error also derives from the builtin it replaced (`ValueError` or `RuntimeError`), so
``except ValueError`` / ``except RuntimeError`` written against older versions still catches it;
``except AnisoError`` catches everything this package raises on purpose.
"""

from __future__ import annotations


class AnisoError(Exception):
    """Base class of every error aniso_plugins raises on purpose (catch this to catch them all)."""


class ConfigError(AnisoError, ValueError):
    """A configuration value is outside its accepted range (raised when `AnisoConfig` is built)."""


class SetupError(AnisoError, RuntimeError):
    """The model or trainer cannot be set up for the configured method (raised before any step runs)."""


class StateError(AnisoError, RuntimeError):
    """A state file or checkpoint entry cannot be loaded into this configuration (raised at resume)."""


__all__ = ["AnisoError", "ConfigError", "SetupError", "StateError"]
