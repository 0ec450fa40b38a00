"""aniso_plugins: measure and counter representation degeneration in language-model training.

Core (trainer-agnostic): the configuration, the plugin manager and its hook specs, reducible
statistics, state files, and the methods and metrics. Trainer adapters live in
``aniso_plugins.integrations.<trainer>``.
"""

__version__ = "0.1.0"

from .agg import AGGGates, agg_gates, agg_linear
from .agg_head import AGGForward
from .bottleneck import bottleneck_finish, bottleneck_stats, gradient_bottleneck, logit_gradient_rank
from .config import AnisoConfig, ConfigError
from .counter import SlidingTokenCounter
from .distributed import LocalRows, full_rows, local_rows
from .errors import AnisoError
from .frequency import CumulativeTargetCounts, frequency_groups
from .fused_ce import agg_cross_entropy
from .geometry import (
    Spectrum,
    effective_rank,
    isotropy,
    mean_cosine,
    normalized_singular_values,
    principal_variance_share,
    singular_entropy,
    spectrum,
    w_error,
)
from .lowrank import LowRankHead, merge_low_rank, merge_low_rank_heads
from .hookspecs import hookimpl
from .isoscore import isoscore
from .loss import attach_loss
from .model import ModelHandle, OutputEmbeddingsHandle, SetupError, detach, find_handle
from .plugins import AnisoPlugins
from .postprocess import (
    AllButTheTop,
    Centering,
    Rotation,
    Transform,
    TransformModule,
    Whitening,
    load_transform,
    outlier_stats,
)
from .reduce import Stat, reduce_stats
from .regularizers import cosine_hinge, cosreg, spectrum_penalty, weight_singular_values
from .state import StateError, load_state, save_state
from .session import TrainingSession
from .simcse import SimCSECollator
from .steps import RunInfo, StepInfo
from .targets import LabelAlignment, alignment_of, causal_targets, sequence_ids

__all__ = [
    "AGGForward",
    "AGGGates",
    "AllButTheTop",
    "AnisoConfig",
    "AnisoError",
    "AnisoPlugins",
    "Centering",
    "ConfigError",
    "CumulativeTargetCounts",
    "LabelAlignment",
    "LocalRows",
    "LowRankHead",
    "ModelHandle",
    "OutputEmbeddingsHandle",
    "Rotation",
    "RunInfo",
    "SetupError",
    "SimCSECollator",
    "SlidingTokenCounter",
    "Spectrum",
    "Stat",
    "StateError",
    "StepInfo",
    "TrainingSession",
    "Transform",
    "TransformModule",
    "Whitening",
    "agg_cross_entropy",
    "agg_gates",
    "agg_linear",
    "alignment_of",
    "attach_loss",
    "bottleneck_finish",
    "bottleneck_stats",
    "causal_targets",
    "cosine_hinge",
    "cosreg",
    "detach",
    "effective_rank",
    "find_handle",
    "frequency_groups",
    "full_rows",
    "gradient_bottleneck",
    "hookimpl",
    "isoscore",
    "isotropy",
    "load_state",
    "load_transform",
    "local_rows",
    "logit_gradient_rank",
    "mean_cosine",
    "merge_low_rank",
    "merge_low_rank_heads",
    "normalized_singular_values",
    "outlier_stats",
    "principal_variance_share",
    "reduce_stats",
    "save_state",
    "sequence_ids",
    "singular_entropy",
    "spectrum",
    "spectrum_penalty",
    "w_error",
    "weight_singular_values",
]
