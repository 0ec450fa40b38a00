"""The plugin manager: builds the plugins for a configuration and drives their hooks.

`AnisoPlugins(config)` registers the built-in `aniso_plugins.core.builtins` module and every module of the
``aniso_plugins`` entry-point group, asks each of them for plugin objects
(`aniso_make_plugins`), registers those, and then offers one method per event of the hook
specs, plus the measurement rounds. It holds no training policy: when loss terms and metrics
are due is `aniso_plugins.TrainingSession`'s, which is what adapters talk to.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence

import pluggy
import torch

from aniso_plugins.core import builtins, hookspecs
from aniso_plugins.core.config import AnisoConfig, ConfigError
from aniso_plugins.core.layout import ParallelLayout
from aniso_plugins.core.model import ModelHandle, SetupError
from aniso_plugins.core.state import load_state, save_state
from aniso_plugins.core.steps import RunInfo, StepInfo
from aniso_plugins.numerics.reduce import Stat, reduce_stats

logger = logging.getLogger("aniso_plugins")

ENTRY_POINT_GROUP = "aniso_plugins"
METRIC_PREFIX = "aniso/"
MAX_METRIC_ROUNDS = 8
_SHARE = "core/activation_loss/"  # reduced statistic: an activation term's shares, summed over ranks


def _plugin_name(plugin: object) -> str:
    return getattr(plugin, "name", None) or type(plugin).__name__


class AnisoPlugins:
    """The plugins configured for one training run, and one method per hook.

    config: the run's `AnisoConfig`.
    plugins: extra plugin objects or modules to register (a third party's own, or tests').
    """

    def __init__(self, config: AnisoConfig | None = None, plugins: Iterable[object] = ()) -> None:
        self.config = config if config is not None else AnisoConfig()
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.pm.register(builtins, name="aniso_plugins.core.builtins")
        if self.config.load_entry_points:
            self.pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        for plugin in plugins:
            self.register(plugin)
        for made in self.pm.hook.aniso_make_plugins(config=self.config):
            for plugin in made or ():
                self.register(plugin)
        self.pm.check_pending()
        self.last_loss_terms: dict[str, torch.Tensor] = {}  # detached, read at the next measurement
        self._shares: dict[str, torch.Tensor] = {}  # this step's activation-term shares, summed
        self._last_shares: dict[str, torch.Tensor] = {}  # ... of the last finished step

    # --- registration -----------------------------------------------------------------------
    def register(self, plugin: object, name: str | None = None) -> object:
        """Register a plugin object or module; returns it. Names must be unique."""
        name = name or _plugin_name(plugin)
        existing = self.pm.get_plugin(name)
        if existing is not None:
            raise ConfigError(
                f"two plugins are named {name!r} ({_describe(existing)} and {_describe(plugin)}): plugin names "
                "must be unique; give one of them another `name`"
            )
        self.pm.register(plugin, name=name)
        return plugin

    def get(self, name: str) -> object | None:
        """The registered plugin called `name`, or None."""
        return self.pm.get_plugin(name)

    @property
    def names(self) -> list[str]:
        """Names of the registered plugins, modules included."""
        return [name for name, _ in self.pm.list_name_plugin()]

    def implements(self, hook: str) -> bool:
        """Whether any registered plugin implements the hook called `hook`."""
        return bool(getattr(self.pm.hook, hook).get_hookimpls())

    # --- events -----------------------------------------------------------------------------
    def head_computes_loss(self, owns_loss: bool, why_not: str) -> bool:
        """Whether a plugin makes the head return the training loss itself (`aniso_head_computes_loss`)."""
        return any(self.pm.hook.aniso_head_computes_loss(owns_loss=owns_loss, why_not=why_not))

    def in_head_forward(self) -> list[str]:
        """The registered plugins that act in the LM head's forward (``acts_in_head_forward``)."""
        return [name for name, plugin in self.pm.list_name_plugin() if getattr(plugin, "acts_in_head_forward", False)]

    def loss_ownership(self, handle: ModelHandle, owns_loss: bool, why_not: str) -> tuple[bool, str]:
        """(whether the head may compute the training loss, why not) after set-up: not where a
        plugin reads the training logits (refused outright on a vocabulary shard), nor where the
        trainer's own loss is chunked (`ParallelLayout.chunked_loss`) and no plugin acts in the head."""
        readers = self.reads_training_logits()
        if readers and handle.vocab_mesh is not None:
            raise SetupError(
                f"{'; '.join(readers)}: under tensor parallelism with loss parallel each rank holds only its "
                f"vocabulary shard of the training logits ({handle.vocab_mesh.size()} shards on "
                f"{handle.vocab_mesh.mesh_dim_names}); measure it in a run without tensor parallelism"
            )
        if owns_loss and readers:
            return False, "; ".join(readers)
        if owns_loss and handle.layout.chunked_loss is not None and not self.in_head_forward():
            return False, "no method acts in the LM head: the trainer's own chunked head runs"
        return owns_loss, why_not or "the adapter cannot"

    def unconsumed_terms(self, step: int) -> str:
        """The error of a step whose loss terms were due in the LM head's training forward, which
        did not run: nothing of the plugins' that act there reached the gradients."""
        return (
            f"step {step}: {', '.join(map(repr, self.in_head_forward()))} add loss terms in the LM head's training "
            "forward, which did not run on the step's last micro-batch (the head ran in eval mode, without gradients, "
            "or the model's training forward computed its loss from the head's weight without calling the head), so "
            "the terms did nothing. Train with a forward that calls the LM head (AnisoConfig(fused_loss=True) keeps "
            "the logits out of memory)"
        )

    def bypass_refusal(self, handle: ModelHandle) -> str | None:
        """Why the plugins that act in the LM head's forward cannot run on `handle`'s model, whose
        forward computes its loss from the head's weight without calling the head
        (`ModelHandle.head_bypass`: they would silently do nothing), or None."""
        acting = self.in_head_forward()
        bypass = handle.head_bypass() if acting else None
        if bypass is None:
            return None
        one = len(acting) == 1
        return (
            f"{', '.join(map(repr, acting))} act{'s' if one else ''} in the LM head's forward, which the model's "
            f"training loss bypasses: {bypass}, so {'it' if one else 'they'} would silently do nothing. Remove that "
            "patch (Liger-Kernel's fused_linear_cross_entropy, Cut Cross-Entropy's cce_patch, a fused-loss plugin) and "
            "set AnisoConfig(fused_loss=True): aniso_plugins' fused loss never holds the logits either, with the "
            "methods applied; or measure metrics only"
        )

    def reads_training_logits(self) -> list[str]:
        """What the plugins read of the training logits (`aniso_reads_training_logits`)."""
        return [why for why in self.pm.hook.aniso_reads_training_logits() if why]

    def supplies_loss(self) -> bool:
        """Whether label-free batches train on the plugins' terms (`aniso_supplies_loss`)."""
        return any(self.pm.hook.aniso_supplies_loss())

    def layout_refusals(self, layout: ParallelLayout) -> list[str]:
        """Why plugins cannot serve `layout` (`aniso_refuse_layout`), in registration order (the
        configuration's); empty if they all can."""
        return [why for why in reversed(self.pm.hook.aniso_refuse_layout(layout=layout)) if why]

    def setup(self, model: ModelHandle) -> None:
        """Head surgery, probes and model-dependent checks; once, before the optimizer exists
        and the model is wrapped."""
        self.pm.hook.aniso_setup(model=model, config=self.config)

    def begin_training(self, run: RunInfo) -> None:
        """Training starts or resumes."""
        self.pm.hook.aniso_begin_training(run=run)

    def step_targets(self, targets: Sequence[torch.Tensor], step: StepInfo) -> None:
        """`aniso_step_targets`: every training micro-batch of the step, before the first forward."""
        self.pm.hook.aniso_step_targets(targets=targets, step=step)

    def targets(self, targets: torch.Tensor, step: StepInfo) -> None:
        """Targets of a training micro-batch (causal shift done), before its forward."""
        self.pm.hook.aniso_targets(targets=targets, step=step)

    def loss_terms(self, step: StepInfo) -> torch.Tensor | None:
        """Sum of the plugins' loss terms for this micro-batch (None if there are none).
        Remembers their values (detached tensors: no host read) for the next measurement."""
        total = None
        values: dict[str, torch.Tensor] = {}
        for terms in self.pm.hook.aniso_loss_terms(step=step):
            for name, term in (terms or {}).items():
                if name in values:
                    raise ConfigError(f"two plugins returned a loss term named {name!r}: give one of them another name")
                values[name] = term.detach()
                total = term if total is None else total + term
        self.last_loss_terms = values
        return total

    def activation_loss_terms(self, hidden: torch.Tensor, targets: torch.Tensor, step: StepInfo) -> torch.Tensor | None:
        """Sum of this rank's shares of the activation-dependent loss terms of one micro-batch
        (None if there are none). Keeps their detached values, summed over the step's
        micro-batches, for the next measurement (reduced over ranks there)."""
        if step.micro_batch == 0:
            self._shares = {}
        total = None
        seen: set[str] = set()
        for terms in self.pm.hook.aniso_activation_loss_terms(hidden=hidden, targets=targets, step=step):
            for name, term in (terms or {}).items():
                if name in seen or name in self.last_loss_terms:
                    raise ConfigError(f"two plugins returned a loss term named {name!r}: give one of them another name")
                seen.add(name)
                value = term.detach().to(torch.float64)
                self._shares[name] = self._shares[name] + value if name in self._shares else value
                total = term if total is None else total + term
        return total

    def step_end(self, step: StepInfo) -> None:
        """After the optimizer step."""
        self._last_shares, self._shares = self._shares, {}
        self.pm.hook.aniso_step_end(step=step)

    def end_training(self, output_dir: str, main_process: bool) -> None:
        """After the last step of a finished training run."""
        self.pm.hook.aniso_end_training(output_dir=output_dir, main_process=main_process)

    def eval_batch(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """One evaluation batch (logits and causally aligned targets)."""
        self.pm.hook.aniso_eval_batch(logits=logits, targets=targets)

    def measure(self, step: StepInfo, kind: str = "train") -> dict[str, float]:
        """Collect, reduce and finish all metrics of `kind` ("train" or "eval"). Collective:
        every rank must call it. Returns ``aniso/``-prefixed names -> floats, identical on
        every rank; for "train" it includes the last loss-term values. Statistics of the
        micro-batches reduce over ``step.batch_group``, those of rows over the world."""
        if kind not in ("train", "eval"):
            raise ValueError(f"kind must be 'train' or 'eval', got {kind!r}")
        reduced: dict[str, torch.Tensor] = {}
        shares = {f"{_SHARE}{k}": Stat(v, over="batch") for k, v in self._last_shares.items()} if kind == "train" else {}
        for round_index in range(MAX_METRIC_ROUNDS):
            stats: dict[str, Stat] = shares if round_index == 0 else {}
            for part in self.pm.hook.aniso_metric_stats(step=step, kind=kind, round_index=round_index, reduced=reduced):
                for name, stat in (part or {}).items():
                    if name in stats or name in reduced:
                        raise ConfigError(f"two metric statistics are named {name!r}: prefix them with the plugin's name")
                    stats[name] = stat
            if not stats:
                break
            reduced.update(reduce_stats(stats, batch_group=step.batch_group))
        else:
            raise RuntimeError(f"metric statistics did not settle in {MAX_METRIC_ROUNDS} rounds")
        out: dict[str, float] = {}
        for part in self.pm.hook.aniso_metrics(step=step, kind=kind, reduced=reduced):
            for name, value in (part or {}).items():
                out[METRIC_PREFIX + name] = float(value)
        if kind == "train":
            terms = self.last_loss_terms  # one read of them all
            read = torch.stack([v.to(torch.float64) for v in terms.values()]).tolist() if terms else []
            out.update({f"{METRIC_PREFIX}loss/{k}": v for k, v in zip(terms, read)})
            out.update({f"{METRIC_PREFIX}loss/{k[len(_SHARE):]}": float(v) for k, v in reduced.items() if k.startswith(_SHARE)})
        return out

    def summary_metrics(self) -> dict[str, str]:
        """Every plugin's `aniso_summary_metrics`: short label -> full metric name (``aniso/...``)."""
        out: dict[str, str] = {}
        for part in reversed(self.pm.hook.aniso_summary_metrics()):  # registration order
            out.update({label: METRIC_PREFIX + name for label, name in (part or {}).items()})
        return out

    def log(self, metrics: Mapping[str, float], step: int, kind: str = "train") -> None:
        """Let plugins observe finished metrics (after the adapter logged them)."""
        self.pm.hook.aniso_log(metrics=metrics, step=step, kind=kind)

    # --- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """All plugins' state, ``{namespace: {key: tensor}}``."""
        state: dict[str, dict[str, torch.Tensor]] = {}
        for part in self.pm.hook.aniso_state_dict():
            for namespace, entries in (part or {}).items():
                if namespace in state:
                    raise ConfigError(f"two plugins saved state under {namespace!r}: each plugin uses its own namespace")
                state[namespace] = dict(entries)
        return state

    def load_state_dict(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Restore all plugins from `state_dict()` output."""
        self.pm.hook.aniso_load_state_dict(state=state)

    def save(self, path: str | os.PathLike) -> None:
        """Write `state_dict()` to a safetensors file (see `aniso_plugins.core.state`)."""
        save_state(path, self.state_dict(), self.config.to_dict())

    def load(self, path: str | os.PathLike) -> None:
        """Load a file written by `save` under a compatible configuration."""
        self.load_state_dict(load_state(path, self.config.to_dict()))


def _describe(plugin: object) -> str:
    if isinstance(plugin, type(os)):
        return f"module {plugin.__name__}"
    return f"{type(plugin).__module__}.{type(plugin).__qualname__}"


__all__ = ["AnisoPlugins", "ENTRY_POINT_GROUP", "METRIC_PREFIX", "logger"]
