"""The built-in methods and metrics, registered through the same hook as third-party plugins.

`aniso_make_plugins` maps the configuration to plugin objects; each lives in its own module
and is imported only when configured.
"""

from __future__ import annotations

from ..config import AnisoConfig
from ..hookspecs import hookimpl


@hookimpl
def aniso_make_plugins(config: AnisoConfig) -> list[object]:
    plugins: list[object] = []
    if config.head != "keep":
        from .heads import HeadPlugin

        plugins.append(HeadPlugin(config))
    if config.method == "agg":
        from .agg import AGGPlugin

        plugins.append(AGGPlugin(config))
    elif config.method in ("cosreg", "hinge", "spectrum"):
        from .regularizers import RegularizerPlugin

        plugins.append(RegularizerPlugin(config))
    counts = None
    if {"frequency", "eval"} & set(config.metrics):  # one shared counter of training targets
        from .target_counts import TargetCountsPlugin

        counts = TargetCountsPlugin()
        plugins.append(counts)
    for metric in config.metrics:
        plugins.append(_metric_plugin(metric, config, counts))
    return plugins


def _metric_plugin(metric: str, config: AnisoConfig, counts: object) -> object:
    if metric == "geometry":
        from .geometry import GeometryPlugin

        return GeometryPlugin(config)
    if metric == "frequency":
        from .frequency import FrequencyGroupsPlugin

        return FrequencyGroupsPlugin(config, counts)
    if metric == "hidden":
        from .hidden import HiddenStatesPlugin

        return HiddenStatesPlugin(config)
    if metric == "bottleneck":
        from .bottleneck import BottleneckPlugin

        return BottleneckPlugin(config)
    from .evaluation import EvalPlugin

    return EvalPlugin(config, counts)
