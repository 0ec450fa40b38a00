"""The built-in methods and metrics, registered through the same hook as third-party plugins.

`aniso_make_plugins` maps the configuration to plugin objects through the name -> class table
in `aniso_plugins.core.registry`; each plugin lives in its own module and is imported only when
configured.
"""

from __future__ import annotations

from aniso_plugins.core import registry
from aniso_plugins.core.config import AnisoConfig
from aniso_plugins.core.hookspecs import hookimpl


@hookimpl
def aniso_make_plugins(config: AnisoConfig) -> list[object]:
    """The head plugin, one plugin per method of ``config.method``, the shared target counter
    (when a metric needs it), the metric plugins in ``config.metrics`` order, the plugin of
    each switched-on `registry.SWITCHES` field and the fused-loss plugin (unless
    ``fused_loss=False``); names that add nothing are skipped."""
    plugins: list[object] = []
    for field, name in [("head", config.head)] + [("method", m) for m in config.method]:
        cls = registry.plugin_class(field, name)
        if cls is not None:
            plugins.append(cls(config))
    counts = None
    if registry.NEEDS_TARGET_COUNTS & set(config.metrics):  # one shared counter of training targets
        counts = registry.resolve(registry.TARGET_COUNTS)()
        plugins.append(counts)
    for metric in config.metrics:
        cls = registry.plugin_class("metrics", metric)
        plugins.append(cls(config, counts) if metric in registry.NEEDS_TARGET_COUNTS else cls(config))
    plugins += [registry.resolve(spec)(config) for field, spec in registry.SWITCHES.items() if getattr(config, field)]
    if config.fused_loss is not False:
        plugins.append(registry.resolve(registry.FUSED_LOSS)(config))
    return plugins
