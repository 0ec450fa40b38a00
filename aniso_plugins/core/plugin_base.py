"""`Plugin`, the base of the built-in plugins: what every one of them repeated (the configuration,
the model handle from set-up, the guard that keeps the training measurement away from
evaluation) written once. pluggy registers hook implementations a class inherits, so a
subclass overrides the plain methods below, not the hooks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from aniso_plugins.core.config import AnisoConfig
from aniso_plugins.core.hookspecs import hookimpl
from aniso_plugins.core.layout import ParallelLayout
from aniso_plugins.core.model import ModelHandle, SetupError
from aniso_plugins.core.steps import StepInfo
from aniso_plugins.numerics.reduce import Stat


class Plugin:
    """A plugin with ``self.config``, ``self.model`` (the `ModelHandle` of `aniso_setup`; reading
    it before set-up raises a `RuntimeError` naming the class) and the train measurement.

    Override `setup` (called by `aniso_setup`), `train_stats` (the rounds of
    `aniso_metric_stats` with ``kind == "train"``) and `train_metrics` (`aniso_metrics` with
    ``kind == "train"``); evaluation measurements never reach them. A plugin that needs other
    hook options (``tryfirst``) or measures evaluation declares that hook itself."""

    name = ""
    acts_in_head_forward: ClassVar[bool] = False
    """Whether the plugin changes training in the LM head's forward or through what the session
    attaches there (gates, loss terms, a fused loss), or reads that forward (the training logits):
    a trainer whose loss bypasses the head's forward (`ParallelLayout.head_bypassed`, or a model
    forward that does, `ModelHandle.head_bypass`) is then refused, since the plugin would do nothing."""
    reads_every_block: ClassVar[bool] = False
    """Whether the plugin reads every block's outputs (`ModelHandle.hook_blocks`): a layout whose
    pipeline stages split the blocks (`ParallelLayout.pipeline_stages`) is then refused."""
    updates_head_rows: ClassVar[bool] = False
    """Whether the plugin changes the head weight's rows between steps itself (Coupled Adam's
    update, μ-centering): a layout whose optimizer steps flat buffers
    (`ParallelLayout.optimizer_flat`) or whose pipeline stages split the model is then refused,
    and so is a head without a (V, d) parameter of its own (`require_head_parameter`)."""
    summary: ClassVar[dict[str, str]] = {}
    """`aniso_summary_metrics`: short label -> metric name, the values shown in the one-line log."""

    def __init__(self, config: AnisoConfig) -> None:
        self.config = config
        self._handle: ModelHandle | None = None

    @hookimpl
    def aniso_summary_metrics(self) -> dict[str, str] | None:
        return dict(self.summary) or None

    @hookimpl
    def aniso_refuse_layout(self, layout: ParallelLayout) -> str | None:
        who = repr(self.name or type(self).__name__)
        if self.acts_in_head_forward and layout.head_bypassed:
            return f"{who} acts in the LM head's forward, which {layout.head_bypassed}"
        if self.reads_every_block and layout.pipeline_stages > 1:
            return (
                f"{who} reads every block's outputs, which pipeline parallelism ({layout.pipeline_stages} stages) splits "
                "over the pipeline stages, each seeing only its own; measure it in a run without pipeline parallelism"
            )
        if self.updates_head_rows and layout.optimizer_flat is not None:
            return f"{who} changes the output embedding's rows between steps, but {layout.optimizer_flat}"
        if self.updates_head_rows and layout.pipeline_stages > 1:
            return (f"{who} under pipeline parallelism ({layout.pipeline_stages} stages) is not supported: train it "
                    "without pipeline parallelism (FSDP2, HSDP and tensor parallelism are exact)")
        return self.refuse_layout(layout)

    def require_head_parameter(self, model: ModelHandle) -> None:
        """Raise `SetupError` unless the head's weight is a trained (V, d) parameter of its own:
        a low-rank head's A·B is a product, which no optimizer updates row by row."""
        if self.config.head == "lowrank":
            raise SetupError(f"{self.name!r} with head='lowrank': the head's weight A·B is no parameter the optimizer "
                             "updates row by row; use head='untie' or 'keep'")
        model.require_trainable_head(repr(self.name))

    def refuse_layout(self, layout: ParallelLayout) -> str | None:
        """Why this plugin cannot serve `layout`, with the way out; None if it can."""
        return None

    @property
    def model(self) -> ModelHandle:
        """The model handle given to `aniso_setup`."""
        if self._handle is None:
            raise RuntimeError(f"{type(self).__name__}: aniso_setup(model, config) must run first")
        return self._handle

    @property
    def is_set_up(self) -> bool:
        return self._handle is not None

    def __dir__(self) -> list[str]:
        # pluggy's register() getattr()s every name in dir(plugin) looking for hook
        # implementations, which would raise `model`'s error: leave it out until set-up.
        names = super().__dir__()
        return names if self.is_set_up else [n for n in names if n != "model"]

    @hookimpl
    def aniso_setup(self, model: ModelHandle, config: AnisoConfig) -> None:
        self._handle = model
        try:
            self.setup(model)
        except BaseException:
            self._handle = None
            raise

    def setup(self, model: ModelHandle) -> None:
        """Check the model and change it (hooks, head surgery); raise before changing anything."""

    @hookimpl
    def aniso_metric_stats(
        self, step: StepInfo, kind: str, round_index: int, reduced: Mapping[str, torch.Tensor]
    ) -> dict[str, Stat] | None:
        return self.train_stats(step, round_index, reduced) if kind == "train" else None

    def train_stats(self, step: StepInfo, round_index: int, reduced: Mapping[str, torch.Tensor]) -> dict[str, Stat] | None:
        """This rank's reducible statistics of round `round_index` of a train measurement."""
        return None

    @hookimpl
    def aniso_metrics(self, step: StepInfo, kind: str, reduced: Mapping[str, torch.Tensor]) -> dict[str, float] | None:
        return self.train_metrics(step, reduced) if kind == "train" else None

    def train_metrics(self, step: StepInfo, reduced: Mapping[str, torch.Tensor]) -> dict[str, float] | None:
        """The finished metrics of a train measurement from the reduced statistics."""
        return None


__all__ = ["Plugin"]
