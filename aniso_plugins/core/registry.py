"""The built-in method, head and metric names and the plugin classes that implement them.

Classes are named by import string (``"package.module:Class"``) and imported only by `resolve`,
so `aniso_plugins.core.config` reads the names from here without importing any plugin module (no
import cycles, and a metric's dependencies load only when it is configured).

Construction (see `aniso_plugins.core.builtins.aniso_make_plugins`): every class is called
with the `AnisoConfig`; the metrics in `NEEDS_TARGET_COUNTS` also get the shared
`TARGET_COUNTS` plugin (one counter of training targets) as second argument. A value of None
means the name adds no plugin (``method="none"``, ``head="keep"``).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from aniso_plugins.core.options import choice_error

_PKG = "aniso_plugins"

METHODS: Mapping[str, str | None] = {
    "none": None,
    "agg": f"{_PKG}.methods.agg.plugin:AGGPlugin",
    "cosreg": f"{_PKG}.methods.regularizers.plugin:RegularizerPlugin",
    "hinge": f"{_PKG}.methods.regularizers.plugin:RegularizerPlugin",
    "spectrum": f"{_PKG}.methods.regularizers.plugin:RegularizerPlugin",
    "simctg": f"{_PKG}.methods.simctg.plugin:SimCTGPlugin",
    "uniformity": f"{_PKG}.methods.uniformity.plugin:UniformityPlugin",
    "simcse": f"{_PKG}.methods.simcse.plugin:SimCSEPlugin",
    "coupled_adam": f"{_PKG}.methods.coupled_adam.plugin:CoupledAdamPlugin",
    "mu_centering": f"{_PKG}.methods.centering.plugin:MuCenteringPlugin",
    "mu_loss": f"{_PKG}.methods.centering.plugin:MuLossPlugin",
}
"""``AnisoConfig.method`` entries -> the training-method plugins (one per configured method)."""

HEADS: Mapping[str, str | None] = {
    "keep": None,
    "untie": f"{_PKG}.methods.heads.plugin:HeadSurgeryPlugin",
    "lowrank": f"{_PKG}.methods.heads.plugin:HeadSurgeryPlugin",
}
"""``AnisoConfig.head`` -> the head-surgery plugin."""

METRICS: Mapping[str, str] = {
    "geometry": f"{_PKG}.metrics.geometry.plugin:GeometryPlugin",
    "frequency": f"{_PKG}.metrics.frequency.plugin:FrequencyGroupsPlugin",
    "hidden": f"{_PKG}.metrics.hidden.plugin:HiddenStatesPlugin",
    "bottleneck": f"{_PKG}.metrics.bottleneck.plugin:BottleneckPlugin",
    "eval": f"{_PKG}.metrics.evaluation.plugin:EvalPlugin",
    "uniformity": f"{_PKG}.methods.uniformity.plugin:UniformityMetricPlugin",
    "ethayarajh": f"{_PKG}.metrics.ethayarajh.plugin:EthayarajhPlugin",
    "under_trained": f"{_PKG}.metrics.under_trained.plugin:UnderTrainedPlugin",
}
"""``AnisoConfig.metrics`` entries -> metric plugins."""

TARGET_COUNTS = f"{_PKG}.metrics.frequency.target_counts:TargetCountsPlugin"
"""The shared counter of training targets (built with no arguments, once per run)."""

NEEDS_TARGET_COUNTS = frozenset({"frequency", "eval", "under_trained"})
"""Metrics constructed as ``cls(config, counts)`` with the shared `TARGET_COUNTS` plugin."""

FUSED_LOSS = f"{_PKG}.methods.fused_loss.plugin:FusedLossPlugin"
"""The plugin that decides and arms the fused loss (``fused_loss``; built for every run)."""

SWITCHES: Mapping[str, str] = {
    "report_at_end": f"{_PKG}.offline.plugin:EndOfTrainingReport",
}
"""Boolean `AnisoConfig` fields -> the plugin added when the field is True."""

TABLES: Mapping[str, Mapping[str, str | None]] = {"method": METHODS, "head": HEADS, "metrics": METRICS}

OPTIONS: tuple[str, ...] = (
    f"{_PKG}.methods.agg.options:AGGOptions",
    f"{_PKG}.methods.regularizers.options:RegularizerOptions",
    f"{_PKG}.methods.simctg.options:SimCTGOptions",
    f"{_PKG}.methods.uniformity.options:UniformityOptions",
    f"{_PKG}.methods.simcse.options:SimCSEOptions",
    f"{_PKG}.methods.coupled_adam.options:CoupledAdamOptions",
    f"{_PKG}.methods.centering.options:CenteringOptions",
    f"{_PKG}.methods.heads.options:HeadOptions",
    f"{_PKG}.methods.fused_loss.options:FusedLossOptions",
    f"{_PKG}.metrics.frequency.options:FrequencyOptions",
    f"{_PKG}.metrics.hidden.options:HiddenOptions",
    f"{_PKG}.metrics.bottleneck.options:BottleneckOptions",
    f"{_PKG}.metrics.ethayarajh.options:EthayarajhOptions",
    f"{_PKG}.metrics.under_trained.options:UnderTrainedOptions",
    f"{_PKG}.offline.options:ReportOptions",
)
"""Each feature's options class (`aniso_plugins.core.options.Options`), in the order of
`AnisoConfig`'s fields; a new feature adds its line here and its table entry above."""

OPTIONS_ENTRY_POINT_GROUP = "aniso_plugins.options"
"""Entry-point group of third-party plugins' options classes: installed, they are fields of
`AnisoConfig` like the built-ins' (flags, YAML keys and keyword arguments alike)."""


def option_classes() -> tuple[type, ...]:
    """The options classes `AnisoConfig` is made of: the built-ins' (`OPTIONS`), then those of
    the installed third-party plugins (`OPTIONS_ENTRY_POINT_GROUP`), each an `Options` dataclass."""
    from importlib.metadata import entry_points

    third_party = tuple(ep.load() for ep in entry_points(group=OPTIONS_ENTRY_POINT_GROUP))
    return tuple(resolve(spec) for spec in OPTIONS) + third_party


def resolve(spec: str) -> type:
    """The class named by an import string ``"package.module:Class"``."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{spec!r}: expected an import string 'package.module:Class'")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def plugin_class(field: str, name: str) -> type | None:
    """The plugin class of the built-in `name` of configuration `field` ("method", "head" or
    "metrics"), or None when the name adds no plugin; an unknown name raises `ConfigError`."""
    table = TABLES[field]
    if name not in table:
        raise choice_error(field, name, tuple(table), {f: tuple(t) for f, t in TABLES.items()})
    spec = table[name]
    return None if spec is None else resolve(spec)


__all__ = [
    "FUSED_LOSS",
    "HEADS",
    "METHODS",
    "METRICS",
    "NEEDS_TARGET_COUNTS",
    "OPTIONS",
    "OPTIONS_ENTRY_POINT_GROUP",
    "SWITCHES",
    "TARGET_COUNTS",
    "option_classes",
    "plugin_class",
    "resolve",
]
