"""Axolotl adapter: a plugin, turned on from the YAML.

    plugins:
      - aniso_plugins.integrations.axolotl.AnisoPlugin
    aniso_method: agg
    aniso_metrics: [geometry, frequency]

Every `AnisoConfig` field is a key ``aniso_<field>``, merged into Axolotl's config schema
(`AnisoArgs`, through ``BasePlugin.get_input_args``) and checked by `AnisoConfig` itself when
Axolotl validates the YAML: a bad value, or an ``aniso_`` key that is no field (which Axolotl's
schema would otherwise drop without a word), stops the run with our error, before a model loads.
The plugin then hands Axolotl's Trainer (``AxolotlTrainer``, or the RL builder's TRL trainer) the
HF adapter's `AnisoCallback` (``add_callbacks_pre_trainer``); everything else is the callback's,
as in `aniso_plugins.integrations.hf`: packed batches (Axolotl's ``sample_packing`` restarts
``position_ids`` per document) are split into their documents, FSDP2 and ZeRO-3 models are read
the way those engines intend.

Refused at validation, naming the key: Axolotl's Liger fused linear cross-entropy
(``liger_fused_linear_cross_entropy: true``) and Cut Cross-Entropy (its plugin, on by default
once listed) with a method that acts in the LM head's forward: both patch the model class so that
the head is never called, and the method would do nothing.

Without any ``aniso_`` key set, the plugin does nothing (Axolotl from 0.21 registers installed
plugins through the ``axolotl.plugins`` entry point, which this package declares).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

try:
    import pydantic
    from axolotl.integrations.base import BasePlugin
except ImportError as e:  # pragma: no cover - exercised only without axolotl
    raise ImportError('aniso_plugins.integrations.axolotl needs axolotl: pip install "aniso-plugins[hf]" axolotl') from e

from aniso_plugins import AnisoConfig, AnisoError, TrainingSession
from aniso_plugins.integrations.hf import AnisoCallback

PREFIX = "aniso_"
"""The prefix of this plugin's keys in an Axolotl YAML: ``aniso_<AnisoConfig field>``."""
LIGER_PLUGIN = "axolotl.integrations.liger.LigerPlugin"
"""Axolotl's Liger plugin, which reads ``liger_fused_linear_cross_entropy``."""
CCE_PLUGIN = "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"
"""Axolotl's Cut Cross-Entropy plugin, whose ``cut_cross_entropy`` key defaults to true."""


def _listed(cfg: Mapping[str, Any], plugin: str) -> bool:
    """Whether `plugin` is in the config's ``plugins``, by its full name or the short one Axolotl
    also loads (``liger.LigerPlugin`` for ``axolotl.integrations.liger.LigerPlugin``)."""
    short = plugin.removeprefix("axolotl.integrations.")
    return any(name in (plugin, short) for name in (cfg.get("plugins") or ()))


def _fields() -> list[str]:
    return [f.name for f in dataclasses.fields(AnisoConfig) if f.init]


def config_from(cfg: Mapping[str, Any]) -> AnisoConfig | None:
    """The `AnisoConfig` of an Axolotl config's ``aniso_`` keys (unset or None: the field's
    default); None when no key is set. Raises `AnisoError` (`AnisoConfig`'s message) on a bad
    value or an ``aniso_`` key that is no field, naming the closest fields."""
    given = {k[len(PREFIX):]: v for k, v in cfg.items() if isinstance(k, str) and k.startswith(PREFIX) and v is not None}
    return AnisoConfig.from_dict(given) if given else None


def head_bypass(cfg: Mapping[str, Any], config: AnisoConfig) -> str | None:
    """Why Axolotl's settings would leave `config`'s methods doing nothing, naming the key and
    the fix; None when they do not. Axolotl's Liger fused linear cross-entropy and its Cut
    Cross-Entropy compute the loss from the hidden states and ``lm_head.weight`` without calling
    the head, where the methods act (`TrainingSession.uses_head_forward`)."""
    keys = []
    if _listed(cfg, LIGER_PLUGIN) and cfg.get("liger_fused_linear_cross_entropy"):
        keys.append("liger_fused_linear_cross_entropy: true")
    if _listed(cfg, CCE_PLUGIN) and cfg.get("cut_cross_entropy", True) is not False:
        keys.append("cut_cross_entropy (the CutCrossEntropyPlugin's, true by default)")
    if not keys:
        return None
    session = TrainingSession(config)
    try:
        if not session.uses_head_forward:
            return None
    finally:
        session.detach()
    return (f"{' and '.join(keys)} compute the loss without calling the LM head, so aniso_method "
            f"{list(config.method)} would act on nothing: set liger_fused_linear_cross_entropy: false and "
            "cut_cross_entropy: false (Liger's other kernels may stay), or leave the aniso_ keys out")


class _AnisoArgsBase(pydantic.BaseModel):
    """Checks every ``aniso_`` key with `AnisoConfig` when Axolotl validates its config."""

    @pydantic.model_validator(mode="before")
    @classmethod
    def _check(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        try:
            config = config_from(data)
        except AnisoError as e:
            raise ValueError(f"aniso_plugins: {e}") from None
        why = None if config is None else head_bypass(data, config)
        if why is not None:
            raise ValueError(f"aniso_plugins: {why}")
        return data


AnisoArgs = pydantic.create_model(
    "AnisoArgs",
    __base__=_AnisoArgsBase,
    __module__=__name__,
    **{PREFIX + name: (Any, None) for name in _fields()},
)
"""Axolotl's input model for this plugin: one optional key ``aniso_<field>`` per `AnisoConfig`
field (values as `AnisoConfig` takes them: ``aniso_method: [agg, simctg]``, ``aniso_alpha: 0.03``)."""


class AnisoPlugin(BasePlugin):
    """``plugins: [aniso_plugins.integrations.axolotl.AnisoPlugin]``: the ``aniso_`` keys in
    Axolotl's schema (`AnisoArgs`) and, when any is set, `AnisoCallback` on Axolotl's Trainer."""

    def get_input_args(self) -> str:
        return f"{__name__}.AnisoArgs"

    def add_callbacks_pre_trainer(self, cfg: Mapping[str, Any], model: Any) -> list[AnisoCallback]:
        config = config_from(cfg)
        if config is None:
            return []
        why = head_bypass(cfg, config)  # also when the schema did not run (a plugin registered late)
        if why is not None:
            raise ValueError(f"aniso_plugins: {why}")
        return [AnisoCallback(config)]


__all__ = ["CCE_PLUGIN", "LIGER_PLUGIN", "PREFIX", "AnisoArgs", "AnisoPlugin", "config_from", "head_bypass"]
