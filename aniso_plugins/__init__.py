"""aniso_plugins: measure and counter representation degeneration in language-model training.

Core (trainer-agnostic): the configuration, the plugin manager and its hook specs, reducible
statistics, state files, and the methods and metrics. Trainer adapters live in
``aniso_plugins.integrations.<trainer>``.
"""

from aniso_plugins.core.version import __version__
from aniso_plugins.core.config import AnisoConfig, ConfigError
from aniso_plugins.core.errors import AnisoError
from aniso_plugins.core.hookspecs import hookimpl
from aniso_plugins.core.loss import attach_loss
from aniso_plugins.core.model import ModelHandle, OutputEmbeddingsHandle, SetupError, detach, find_handle
from aniso_plugins.core.plugins import AnisoPlugins
from aniso_plugins.core.session import TrainingSession
from aniso_plugins.core.state import StateError, load_state, save_state
from aniso_plugins.core.steps import RunInfo, StepInfo
from aniso_plugins.core.targets import LabelAlignment, alignment_of, causal_targets, sequence_ids
from aniso_plugins.methods.agg.counter import SlidingTokenCounter
from aniso_plugins.methods.agg.fused_ce import agg_cross_entropy
from aniso_plugins.methods.agg.gates import AGGGates, agg_gates, agg_linear
from aniso_plugins.methods.agg.head import AGGForward
from aniso_plugins.methods.heads.lowrank import LowRankHead, merge_low_rank, merge_low_rank_heads
from aniso_plugins.methods.regularizers.penalties import cosine_hinge, cosreg, spectrum_penalty, weight_singular_values
from aniso_plugins.methods.simcse.contrastive import SimCSECollator
from aniso_plugins.metrics.bottleneck.probe import (
    bottleneck_finish,
    bottleneck_stats,
    gradient_bottleneck,
    logit_gradient_rank,
)
from aniso_plugins.metrics.frequency.groups import CumulativeTargetCounts, frequency_groups
from aniso_plugins.metrics.geometry.isoscore import isoscore
from aniso_plugins.metrics.geometry.rounds import isotropy
from aniso_plugins.metrics.geometry.stats import (
    Spectrum,
    effective_rank,
    mean_cosine,
    normalized_singular_values,
    principal_variance_share,
    singular_entropy,
    spectrum,
    w_error,
)
from aniso_plugins.numerics.distributed import LocalRows, full_rows, local_rows
from aniso_plugins.numerics.reduce import Stat, reduce_stats
from aniso_plugins.offline.postprocess import (
    AllButTheTop,
    Centering,
    Rotation,
    Transform,
    TransformModule,
    Whitening,
    load_transform,
    outlier_stats,
)

__all__ = [
    "__version__",
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
