"""A complete third-party plugin, small enough to copy.

It adds one loss term (an L2 penalty c·‖W‖²_F on the LM head) and one metric (the
root-mean-square norm of the head's rows), both distributed-safe:

- the metric is computed from this rank's rows (`local_rows`) as a reducible sum, so the core
  adds the ranks up in its single reduction and every rank gets the same value;
- the loss term is evaluated on the full head weight, which every rank holds during the
  forward (DDP replica, or the FSDP2-unsharded parameter), so it is the global value.

Its one option, ``head_norm_coef``, is declared beside it (`HeadNormOptions`, in
``head_norm_options.py``: an options module imports only `aniso_plugins.core.options`, since it
may be loaded while `AnisoConfig` is being built) exactly as the built-in features declare theirs. Register it either in code::

    config = AnisoConfig.extend(HeadNormOptions)(method="agg", head_norm_coef=1e-4)  # AnisoConfig + its field
    AnisoPlugins(config, plugins=[HeadNormPlugin.from_config(config)])

(or simply ``plugins=[HeadNormPlugin(coef=1e-4)]``), or, from your own package, through the two
entry-point groups (pyproject.toml)::

    [project.entry-points.aniso_plugins]
    head_norm_plugins = "your_package.third_party_plugin"
    [project.entry-points."aniso_plugins.options"]
    head_norm = "your_package.head_norm_options:HeadNormOptions"

in which case ``head_norm_coef`` is a field of `AnisoConfig` itself (a keyword argument, an
HfArgumentParser / tyro flag, a LightningCLI YAML key, checked by `HeadNormOptions.validate`)
and the module-level `aniso_make_plugins` below builds the plugin object from it.
"""

from __future__ import annotations

import torch
from head_norm_options import HeadNormOptions

from aniso_plugins import AnisoConfig, ModelHandle, Stat, StepInfo, hookimpl, local_rows


class HeadNormPlugin:
    name = "head_norm"

    def __init__(self, coef: float = 1e-4) -> None:
        self.coef = coef
        self.model: ModelHandle | None = None

    @classmethod
    def from_config(cls, config: AnisoConfig) -> HeadNormPlugin:
        return cls(getattr(config, "head_norm_coef", HeadNormOptions.head_norm_coef))

    @hookimpl
    def aniso_setup(self, model: ModelHandle, config: AnisoConfig) -> None:
        self.model = model

    @hookimpl
    def aniso_loss_terms(self, step: StepInfo) -> dict[str, torch.Tensor]:
        weight = self.model.head().weight
        return {"head_l2": self.coef * weight.float().pow(2).sum()}

    @hookimpl
    def aniso_metric_stats(self, step, kind, round_index, reduced):
        if kind != "train" or round_index > 0:  # one round: a sum over this rank's rows
            return None
        rows = local_rows(self.model.head().weight.detach()).rows.double()
        return {
            "head_norm/sq": Stat(rows.pow(2).sum()),
            "head_norm/n": Stat(torch.tensor(float(rows.shape[0]), dtype=torch.float64)),
        }

    @hookimpl
    def aniso_metrics(self, step, kind, reduced):
        if kind != "train":
            return None
        return {"head_norm/rms_row_norm": float((reduced["head_norm/sq"] / reduced["head_norm/n"]).sqrt())}


@hookimpl
def aniso_make_plugins(config: AnisoConfig) -> list[object]:
    return [HeadNormPlugin.from_config(config)]
