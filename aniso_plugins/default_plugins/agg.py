"""The AGG plugin: token counter + gates + gated LM head, wired into the core's hooks.

Per training micro-batch (`aniso_targets`): count its targets (summed across data-parallel
ranks), compute the gates from the appearance that now includes them (the official order,
methods.md §1.1), and arm the head's gated forward with both. After the optimizer step
(`aniso_step_end`): advance the counter. Validation and evaluation never reach the counter
(no `aniso_targets` for them, and the head gates only in training mode with grad enabled).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ..agg import AGGGates, AGGHead, agg_gates
from ..config import AnisoConfig, ConfigError
from ..counter import TokenCounter
from ..distributed import is_distributed
from ..hookspecs import hookimpl
from ..model import ModelHandle
from ..steps import StepInfo

NAMESPACE = "agg"
logger = logging.getLogger("aniso_plugins")


class AGGPlugin:
    """AGG (Yu et al., ACL 2022) as a plugin; reads ``alpha``, ``window``, ``special_ids``,
    ``ignore_index`` and the ``agg_*`` ablations of `AnisoConfig`.

    window: ``config.window``, else ``StepInfo.epoch_steps`` from the adapter (the paper's one
    epoch of optimizer steps), else a `ConfigError` at the first training micro-batch.
    `process_group`: the data-parallel group whose ranks' counts are summed (default: the world);
    an adapter with tensor or pipeline parallel ranks that see the same targets sets it.

    Adapters read `head` (the `AGGHead`; an adapter that owns the loss removes it) and
    `last_gates` (the gates of the latest micro-batch, for `aniso_plugins.agg_cross_entropy`).
    """

    name = "agg"

    def __init__(self, config: AnisoConfig) -> None:
        self.config = config
        self.process_group: dist.ProcessGroup | None = None
        self.head: AGGHead | None = None
        self.counter: TokenCounter | None = None
        self.vocab_size: int | None = None
        self.last_gates: AGGGates | None = None
        self._static: tuple[torch.Tensor, int] | None = None  # (appearance, steps) frozen by agg_static_after
        self._pending_state: dict[str, torch.Tensor] | None = None
        self._step_warned = False

    # --- hooks --------------------------------------------------------------------------------
    @hookimpl
    def aniso_setup(self, model: ModelHandle, config: AnisoConfig) -> None:
        self.vocab_size = model.vocab_size
        # With agg_fused the adapter owns the loss (the fused AGG cross-entropy) and reads
        # `last_gates`; otherwise the head itself gates (agg_linear).
        self.head = None if config.agg_fused else AGGHead(model.head(), ignore_index=config.ignore_index)

    @hookimpl
    def aniso_targets(self, targets: torch.Tensor, step: StepInfo) -> None:
        counter = self._counter(step)
        if step.step != counter.step_index and not self._step_warned:
            self._step_warned = True
            logger.warning(
                "AGG: the trainer is at step %d but the token counter at step %d (no AGG state was "
                "restored?); the counter keeps its own step index",
                step.step,
                counter.step_index,
            )
        counter.update(targets, all_reduce=is_distributed(), group=self.process_group)
        gates = self._gates(counter)
        self.last_gates = gates
        if self.head is not None:
            self.head.arm(targets, gates)

    @hookimpl
    def aniso_step_end(self, step: StepInfo) -> None:
        if self.head is not None:
            self.head.disarm()
        if self.counter is None:
            return
        after = self.config.agg_static_after
        if after is not None and self._static is None and self.counter.step_index >= after:
            self._static = (self.counter.appearance(), self.counter.steps_in_window)
        self.counter.step()

    @hookimpl
    def aniso_metrics(self, step: StepInfo, kind: str, reduced: Mapping[str, torch.Tensor]) -> dict[str, float] | None:
        # Counts are summed across ranks in aniso_targets, so these are identical on every rank
        # and need no reduction.
        if kind != "train" or self.last_gates is None:
            return None
        gates = self.last_gates
        rare = gates.rare
        n_rare = int(rare.sum())
        nan = float("nan")
        return {
            "agg/rare_size": float(n_rare),
            "agg/g1_mean_rare": float(gates.g1[rare].mean()) if n_rare else nan,
            "agg/g2_mean_rare": float(gates.g2[rare].mean()) if n_rare else nan,
            "agg/counter_bytes": float(self.counter.nbytes),
        }

    @hookimpl
    def aniso_state_dict(self) -> dict[str, dict[str, torch.Tensor]] | None:
        if self.counter is None:
            return None if self._pending_state is None else {NAMESPACE: dict(self._pending_state)}
        state = self.counter.state_dict()
        if self._static is not None:
            state["static_appearance"] = self._static[0]
            state["static_steps"] = torch.tensor([self._static[1]], dtype=torch.int64)
        return {NAMESPACE: state}

    @hookimpl
    def aniso_load_state_dict(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        mine = state.get(NAMESPACE)
        if mine is None:
            return
        self._pending_state = dict(mine)
        if self.counter is not None:
            self._apply_state()

    # --- internals ------------------------------------------------------------------------------
    def _counter(self, step: StepInfo) -> TokenCounter:
        if self.counter is not None:
            return self.counter
        if self.vocab_size is None:
            raise RuntimeError("AGG: aniso_targets before aniso_setup (the adapter must call AnisoPlugins.setup first)")
        window = self.config.window or step.epoch_steps
        if window is None:
            raise ConfigError(
                "window=None: AGG needs the token-counter window K (optimizer steps remembered; the paper "
                "uses one epoch) and the trainer did not report its steps per epoch: set AnisoConfig(window=...)"
            )
        bad = [i for i in self.config.special_ids if i >= self.vocab_size]
        if bad:
            raise ConfigError(
                f"special_ids={self.config.special_ids!r}: ids {bad} are >= the vocabulary size {self.vocab_size}"
            )
        self.counter = TokenCounter(
            self.vocab_size, window, always_frequent=self.config.special_ids, ignore_index=self.config.ignore_index
        )
        if self._pending_state is not None:
            self._apply_state()
        return self.counter

    def _apply_state(self) -> None:
        state = self._pending_state
        self.counter.load_state_dict(state)
        if "static_appearance" in state:
            self._static = (state["static_appearance"].to(torch.float32), int(state["static_steps"][0]))
        self._pending_state = None

    def _gates(self, counter: TokenCounter) -> AGGGates:
        c = self.config
        appearance, steps = self._static or (counter.appearance(), counter.steps_in_window)
        return agg_gates(
            appearance,
            c.alpha,
            steps=steps,
            g1=c.agg_g1,
            g2=c.agg_g2,
            parts=c.agg_parts,
            freeze_rare=c.agg_freeze_rare,
        )


__all__ = ["AGGPlugin"]
