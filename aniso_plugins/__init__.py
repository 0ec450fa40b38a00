"""aniso_plugins: measure and counter representation degeneration in language-model training.

Core (trainer-agnostic): the configuration, the plugin manager and its hook specs, reducible
statistics, state files, and the methods and metrics. Trainer adapters live in
``aniso_plugins.integrations.<trainer>``.
"""

__version__ = "0.1.0"

from .config import AnisoConfig, ConfigError
from .distributed import LocalRows, full_rows, local_rows
from .hookspecs import hookimpl
from .loss import attach_loss
from .model import ModelHandle, SetupError
from .plugins import AnisoPlugins
from .reduce import Stat, reduce_stats
from .state import StateError, load_state, save_state
from .steps import StepInfo

__all__ = [
    "AnisoConfig",
    "AnisoPlugins",
    "ConfigError",
    "LocalRows",
    "ModelHandle",
    "SetupError",
    "Stat",
    "StateError",
    "StepInfo",
    "attach_loss",
    "full_rows",
    "hookimpl",
    "load_state",
    "local_rows",
    "reduce_stats",
    "save_state",
]
