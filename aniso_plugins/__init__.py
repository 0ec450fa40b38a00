"""aniso_plugins: measure and counter representation degeneration in language-model training.

Core (trainer-agnostic): the configuration, the plugin manager and its hook specs, reducible
statistics, state files, and the methods and metrics. What the adapters know of transformers
models (their loss, head, label alignment, PEFT wrappers) is ``aniso_plugins.models``; trainer
adapters live in ``aniso_plugins.integrations.<trainer>``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from aniso_plugins.core.version import __version__

_EXPORTS: dict[str, str] = {
    "AGGGatingWarning": "aniso_plugins.methods.agg.plugin",
    "AllButTheTop": "aniso_plugins.offline.postprocess",
    "AnisoConfig": "aniso_plugins.core.config",
    "AnisoError": "aniso_plugins.core.errors",
    "AnisoPlugins": "aniso_plugins.core.plugins",
    "Centering": "aniso_plugins.offline.postprocess",
    "ConfigError": "aniso_plugins.core.config",
    "CumulativeTargetCounts": "aniso_plugins.metrics.frequency.groups",
    "DeepSpeedLossScale": "aniso_plugins.core.loss_scale",
    "GradScaler": "aniso_plugins.core.session",
    "LabelAlignment": "aniso_plugins.core.targets",
    "LocalRows": "aniso_plugins.numerics.distributed",
    "LogitTransform": "aniso_plugins.methods.fused_loss.logit_transform",
    "LowRankHead": "aniso_plugins.methods.heads.lowrank",
    "MicroBatchTargets": "aniso_plugins.core.targets",
    "ModelHandle": "aniso_plugins.core.model",
    "OutputEmbeddingsHandle": "aniso_plugins.models.handle",
    "ParallelLayout": "aniso_plugins.core.layout",
    "Rotation": "aniso_plugins.offline.postprocess",
    "RowGates": "aniso_plugins.methods.fused_loss.row_gates",
    "RunInfo": "aniso_plugins.core.steps",
    "SetupError": "aniso_plugins.core.model",
    "SimCSECollator": "aniso_plugins.methods.simcse.contrastive",
    "SlidingTokenCounter": "aniso_plugins.methods.agg.counter",
    "Spectrum": "aniso_plugins.metrics.geometry.stats",
    "Stat": "aniso_plugins.numerics.reduce",
    "StateError": "aniso_plugins.core.state",
    "StepInfo": "aniso_plugins.core.steps",
    "TargetRule": "aniso_plugins.core.targets",
    "TrainingHead": "aniso_plugins.methods.fused_loss.head",
    "TrainingSession": "aniso_plugins.core.session",
    "Transform": "aniso_plugins.offline.postprocess",
    "TransformModule": "aniso_plugins.offline.postprocess",
    "Whitening": "aniso_plugins.offline.postprocess",
    "agg_gates": "aniso_plugins.methods.agg.gates",
    "alignment_of": "aniso_plugins.models.alignment",
    "attach_loss": "aniso_plugins.core.loss",
    "bottleneck_finish": "aniso_plugins.metrics.bottleneck.probe",
    "bottleneck_stats": "aniso_plugins.metrics.bottleneck.probe",
    "causal_targets": "aniso_plugins.core.targets",
    "cosine_hinge": "aniso_plugins.methods.regularizers.penalties",
    "cosreg": "aniso_plugins.methods.regularizers.penalties",
    "detach": "aniso_plugins.core.model",
    "effective_rank": "aniso_plugins.metrics.geometry.stats",
    "find_handle": "aniso_plugins.models.handle",
    "frequency_groups": "aniso_plugins.metrics.frequency.groups",
    "full_rows": "aniso_plugins.numerics.distributed",
    "fused_linear_cross_entropy": "aniso_plugins.methods.fused_loss.cross_entropy",
    "FusedCrossEntropyOutput": "aniso_plugins.methods.fused_loss.token_outputs",
    "gated_linear": "aniso_plugins.methods.fused_loss.linear",
    "gradient_bottleneck": "aniso_plugins.metrics.bottleneck.probe",
    "hookimpl": "aniso_plugins.core.hookspecs",
    "isoscore": "aniso_plugins.metrics.geometry.isoscore",
    "isotropy": "aniso_plugins.metrics.geometry.rounds",
    "load_state": "aniso_plugins.core.state",
    "load_transform": "aniso_plugins.offline.postprocess",
    "local_rows": "aniso_plugins.numerics.distributed",
    "logit_gradient_rank": "aniso_plugins.metrics.bottleneck.probe",
    "mean_cosine": "aniso_plugins.metrics.geometry.stats",
    "merge_low_rank": "aniso_plugins.methods.heads.lowrank",
    "merge_low_rank_heads": "aniso_plugins.methods.heads.lowrank",
    "micro_batch_targets": "aniso_plugins.core.targets",
    "normalized_singular_values": "aniso_plugins.metrics.geometry.stats",
    "outlier_stats": "aniso_plugins.offline.postprocess",
    "principal_variance_share": "aniso_plugins.metrics.geometry.stats",
    "reduce_stats": "aniso_plugins.numerics.reduce",
    "save_state": "aniso_plugins.core.state",
    "sequence_ids": "aniso_plugins.core.targets",
    "singular_entropy": "aniso_plugins.metrics.geometry.stats",
    "spectrum": "aniso_plugins.metrics.geometry.stats",
    "spectrum_penalty": "aniso_plugins.methods.regularizers.penalties",
    "target_rule": "aniso_plugins.core.targets",
    "w_error": "aniso_plugins.metrics.geometry.stats",
    "weight_singular_values": "aniso_plugins.methods.regularizers.penalties",
}
"""Public name -> its module. Imported on first use (PEP 562), so ``import aniso_plugins`` and the
``aniso`` command start without torch; ``from aniso_plugins import AnisoConfig`` works as usual."""


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aniso_plugins' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # the same names, for type checkers and editors
    from aniso_plugins.core.config import AnisoConfig, ConfigError
    from aniso_plugins.core.errors import AnisoError
    from aniso_plugins.core.hookspecs import hookimpl
    from aniso_plugins.core.layout import ParallelLayout
    from aniso_plugins.core.loss import attach_loss
    from aniso_plugins.core.loss_scale import DeepSpeedLossScale, GradScaler
    from aniso_plugins.core.model import ModelHandle, SetupError, detach
    from aniso_plugins.core.plugins import AnisoPlugins
    from aniso_plugins.core.session import TrainingSession
    from aniso_plugins.core.state import StateError, load_state, save_state
    from aniso_plugins.core.steps import RunInfo, StepInfo
    from aniso_plugins.core.targets import (
        LabelAlignment,
        MicroBatchTargets,
        TargetRule,
        causal_targets,
        micro_batch_targets,
        sequence_ids,
        target_rule,
    )
    from aniso_plugins.methods.agg.counter import SlidingTokenCounter
    from aniso_plugins.methods.agg.plugin import AGGGatingWarning
    from aniso_plugins.methods.agg.gates import agg_gates
    from aniso_plugins.methods.fused_loss.cross_entropy import fused_linear_cross_entropy
    from aniso_plugins.methods.fused_loss.head import TrainingHead
    from aniso_plugins.methods.fused_loss.linear import gated_linear
    from aniso_plugins.methods.fused_loss.logit_transform import LogitTransform
    from aniso_plugins.methods.fused_loss.row_gates import RowGates
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
    from aniso_plugins.models.alignment import alignment_of
    from aniso_plugins.models.handle import OutputEmbeddingsHandle, find_handle
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
    "AGGGatingWarning",
    "AllButTheTop",
    "AnisoConfig",
    "AnisoError",
    "AnisoPlugins",
    "Centering",
    "ConfigError",
    "CumulativeTargetCounts",
    "DeepSpeedLossScale",
    "GradScaler",
    "LabelAlignment",
    "LocalRows",
    "LogitTransform",
    "LowRankHead",
    "MicroBatchTargets",
    "ModelHandle",
    "OutputEmbeddingsHandle",
    "ParallelLayout",
    "Rotation",
    "RowGates",
    "RunInfo",
    "SetupError",
    "SimCSECollator",
    "SlidingTokenCounter",
    "Spectrum",
    "Stat",
    "StateError",
    "StepInfo",
    "TargetRule",
    "TrainingHead",
    "TrainingSession",
    "Transform",
    "TransformModule",
    "Whitening",
    "agg_gates",
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
    "fused_linear_cross_entropy",
    "FusedCrossEntropyOutput",
    "gated_linear",
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
    "micro_batch_targets",
    "normalized_singular_values",
    "outlier_stats",
    "principal_variance_share",
    "reduce_stats",
    "save_state",
    "sequence_ids",
    "singular_entropy",
    "spectrum",
    "spectrum_penalty",
    "target_rule",
    "w_error",
    "weight_singular_values",
]
