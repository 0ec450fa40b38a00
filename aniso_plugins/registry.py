"""The built-in method, head and metric names and the plugin classes that implement them.

Classes are named by import string (``"package.module:Class"``) and imported only by `resolve`,
so `aniso_plugins.config` reads the names from here without importing any plugin module (no
import cycles, and a metric's dependencies load only when it is configured).

Construction (see `aniso_plugins.default_plugins.aniso_make_plugins`): every class is called
with the `AnisoConfig`; the metrics in `NEEDS_TARGET_COUNTS` also get the shared
`TARGET_COUNTS` plugin (one counter of training targets) as second argument. A value of None
means the name adds no plugin (``method="none"``, ``head="keep"``).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from .errors import ConfigError

_PKG = "aniso_plugins.default_plugins"

METHODS: Mapping[str, str | None] = {
    "none": None,
    "agg": f"{_PKG}.agg:AGGPlugin",
    "cosreg": f"{_PKG}.regularizers:RegularizerPlugin",
    "hinge": f"{_PKG}.regularizers:RegularizerPlugin",
    "spectrum": f"{_PKG}.regularizers:RegularizerPlugin",
    "simctg": f"{_PKG}.simctg:SimCTGPlugin",
    "uniformity": f"{_PKG}.uniformity:UniformityPlugin",
    "simcse": f"{_PKG}.simcse:SimCSEPlugin",
}
"""``AnisoConfig.method`` entries -> the training-method plugins (one per configured method)."""

HEADS: Mapping[str, str | None] = {
    "keep": None,
    "untie": f"{_PKG}.head_surgery:HeadSurgeryPlugin",
    "lowrank": f"{_PKG}.head_surgery:HeadSurgeryPlugin",
}
"""``AnisoConfig.head`` -> the head-surgery plugin."""

METRICS: Mapping[str, str] = {
    "geometry": f"{_PKG}.geometry:GeometryPlugin",
    "frequency": f"{_PKG}.frequency:FrequencyGroupsPlugin",
    "hidden": f"{_PKG}.hidden:HiddenStatesPlugin",
    "bottleneck": f"{_PKG}.bottleneck:BottleneckPlugin",
    "eval": f"{_PKG}.evaluation:EvalPlugin",
    "uniformity": f"{_PKG}.uniformity:UniformityMetricPlugin",
    "ethayarajh": f"{_PKG}.ethayarajh:EthayarajhPlugin",
}
"""``AnisoConfig.metrics`` entries -> metric plugins."""

TARGET_COUNTS = f"{_PKG}.target_counts:TargetCountsPlugin"
"""The shared counter of training targets (built with no arguments, once per run)."""

NEEDS_TARGET_COUNTS = frozenset({"frequency", "eval"})
"""Metrics constructed as ``cls(config, counts)`` with the shared `TARGET_COUNTS` plugin."""

TABLES: Mapping[str, Mapping[str, str | None]] = {"method": METHODS, "head": HEADS, "metrics": METRICS}


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
        raise ConfigError(f"{field}={name!r}: expected one of {', '.join(table)}")
    spec = table[name]
    return None if spec is None else resolve(spec)


__all__ = ["HEADS", "METHODS", "METRICS", "NEEDS_TARGET_COUNTS", "TARGET_COUNTS", "plugin_class", "resolve"]
