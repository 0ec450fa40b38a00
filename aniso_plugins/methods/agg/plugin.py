"""The AGG plugin: token counter + gates + gated LM head, wired into the core's hooks.

At set-up (`aniso_setup`): check ``special_ids`` against the vocabulary and install the training
head (`aniso_plugins.methods.fused_loss.head.TrainingHead`, marked gated) on the model's LM head. When training begins
(`aniso_begin_training`): build the token counter with window K = ``config.window``, else the
trainer's epoch length. Per optimizer step, before its first forward (`aniso_step_targets`):
count the targets of all its micro-batches (summed across data-parallel ranks) and compute the
gates from the appearance that now includes them (the official order, docs/methods.md §1.1), so
that every micro-batch of the step is gated by the whole step's counts, whatever the split into
micro-batches and ranks. Per training micro-batch (`aniso_targets`): arm the head with its
targets and the step's gates (where the adapter owns the loss, the fused-loss plugin then makes
the head return the fused AGG cross-entropy); a step of one micro-batch may come without the
step's announcement. After the
optimizer step (`aniso_step_end`): check, once the counter's window is full, that the rare group
holds some but at most half of the window's target tokens (else one `AGGGatingWarning`, also on
the ``aniso_plugins`` logger, naming the setting that would gate a chosen share), then advance
the counter. Validation and evaluation never reach the counter (no `aniso_targets` for them, and
the head gates only in training mode with grad enabled).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from aniso_plugins.core.config import AnisoConfig, ConfigError
from aniso_plugins.core.hookspecs import hookimpl
from aniso_plugins.core.model import ModelHandle, SetupError
from aniso_plugins.core.plugin_base import Plugin
from aniso_plugins.core.steps import RunInfo, StepInfo
from aniso_plugins.methods.agg.counter import SlidingTokenCounter
from aniso_plugins.methods.agg.gates import agg_gates, rare_fraction_alpha
from aniso_plugins.methods.agg.options import DEFAULT_ALPHA
from aniso_plugins.methods.fused_loss.head import TrainingHead, check_linear_head
from aniso_plugins.methods.fused_loss.row_gates import RowGates
from aniso_plugins.numerics.distributed import is_distributed, world_group

NAMESPACE = "agg"
logger = logging.getLogger("aniso_plugins")
SUGGESTED_FRACTION = 0.05
"""The share of the target tokens the warning's suggested setting gates."""


class AGGGatingWarning(UserWarning):
    """AGG's rare group holds none of the target tokens of its full window, or more than half of
    them (docs/methods.md §1.1, "Gating check"): AGG changes nothing, or gates most of the head's
    gradient."""


class AGGPlugin(Plugin):
    """AGG (Yu et al., ACL 2022) as a plugin; reads ``alpha`` (or ``rare_fraction``),
    ``alpha_tokens``, ``window``, ``special_ids``, ``ignore_index`` and the ``agg_*`` ablations of
    `AnisoConfig`.

    window: ``config.window``, else ``RunInfo.epoch_steps`` from the adapter (the paper's one
    epoch of optimizer steps), else a `ConfigError` when training begins.
    """

    name = "agg"
    acts_in_head_forward = True
    summary = {"AGG gated": "agg/rare_target_fraction"}

    def __init__(self, config: AnisoConfig) -> None:
        super().__init__(config)
        self.head: TrainingHead | None = None
        self.counter: SlidingTokenCounter | None = None
        self.vocab_size: int | None = None
        self.last_gates: RowGates | None = None
        self.last_alpha: float | None = None  # the α of last_gates (chosen each time under rare_fraction)
        # (appearance, steps, α or None) frozen by agg_static_after
        self._static: tuple[torch.Tensor, int, float | None] | None = None
        self._step_warned = False
        self._rarity_told = False  # the info line of the first measurement
        self._gating_warned = False  # the AGGGatingWarning, once a run
        self._counted_step: int | None = None  # the optimizer step whose targets are counted

    # --- hooks --------------------------------------------------------------------------------
    def setup(self, model: ModelHandle) -> None:
        config = self.config
        vocab = model.vocab_size
        bad = [i for i in config.special_ids if i >= vocab]
        if bad:
            raise ConfigError(f"special_ids={config.special_ids!r}: ids {bad} are >= the vocabulary size {vocab}")
        model.require_trainable_head("method='agg'")
        head = model.head()
        check_linear_head(head, framework_forward=model.framework_wraps_head_forward)
        self.vocab_size = vocab
        self.head = TrainingHead(head, ignore_index=config.ignore_index, shard=model.vocab_shard(),
                                 backward_twice=model.backward_runs_twice)
        self.head.gated = True
        model.on_restore(self.head.remove)

    @hookimpl
    def aniso_begin_training(self, run: RunInfo) -> None:
        self._check_head_in_place()
        window = self.config.window or run.epoch_steps
        if window is None:
            raise ConfigError(
                "window=None: AGG needs the token-counter window K (optimizer steps remembered; the paper "
                "uses one epoch) and the trainer did not report its steps per epoch (streaming data): set "
                "AnisoConfig(window=K), in torchtitan --aniso.window K"
            )
        if self.counter is not None and self.counter.window == window:
            return  # training again with the same window: keep the counts
        self.counter = SlidingTokenCounter(
            self.vocab_size, window, always_frequent=self.config.special_ids, ignore_index=self.config.ignore_index,
            device=self.model.device,  # the model's device, where it trains by now
        )
        self._static = None

    @hookimpl
    def aniso_step_targets(self, targets: Sequence[torch.Tensor], step: StepInfo) -> None:
        self._count(targets, step)

    @hookimpl
    def aniso_targets(self, targets: torch.Tensor, step: StepInfo) -> None:
        self._ready()
        self._check_consumed(step)
        if self._counted_step != step.step:
            if step.accumulation_steps > 1:
                raise SetupError(
                    f"AGG: step {step.step} has {step.accumulation_steps} micro-batches, but its targets were not "
                    "announced before the first forward: AGG gates every micro-batch with the counts of the optimizer "
                    "step's whole batch, so the adapter must call TrainingSession.begin_step(batches, step=...) before "
                    "the step's first micro-batch (the HF, Lightning and torchtitan adapters do)"
                )
            self._count([targets], step)  # a step of one micro-batch: it is the whole batch
        self.head.arm(targets, self.last_gates, chunks=step.head_calls)

    def _count(self, targets: Sequence[torch.Tensor], step: StepInfo) -> None:
        """Count the optimizer step's targets (summed across the batch's ranks) and compute its
        gates from the appearance that now includes them (the official order, docs/methods.md §1.1)."""
        counter = self._ready()
        for part in targets:
            if part.dtype.is_floating_point or part.dtype.is_complex or part.dtype == torch.bool:
                raise SetupError(
                    f"AGG: the training targets are {part.dtype}, not integer token ids: the batch's 'labels' (or the "
                    "targets function) must hold token ids (e.g. labels=input_ids.clone(), torch.long)"
                )
        if step.step != counter.step_index and not self._step_warned:
            self._step_warned = True
            logger.warning(
                "AGG: the trainer is at step %d but the token counter at step %d (no AGG state was "
                "restored?); the counter keeps its own step index",
                step.step,
                counter.step_index,
            )
        try:
            counter.update(targets, all_reduce=is_distributed(), group=step.batch_group)
        except ValueError as e:
            shape = tuple(self.head.module.weight.shape)
            raise SetupError(
                f"AGG: {e}. The vocabulary size {counter.vocab_size} is the first dimension of the LM head's weight "
                f"{shape}; targets must be token ids below it (or ignore_index={self.config.ignore_index})"
            ) from e
        self.last_gates = self._gates(counter)
        self._counted_step = step.step

    @hookimpl
    def aniso_step_end(self, step: StepInfo) -> None:
        counter = self._ready()
        self._check_consumed(step)
        self._counted_step = None
        self._check_gating(counter, step)
        after = self.config.agg_static_after
        if after is not None and self._static is None and counter.step_index >= after:
            appearance = self._appearance(counter)
            self._static = (appearance, counter.steps_in_window, self._alpha(counter, appearance))
        counter.step()

    def train_metrics(self, step: StepInfo, reduced: Mapping[str, torch.Tensor]) -> dict[str, float] | None:
        # Counts are summed across ranks when counted, so these are identical on every rank
        # and need no reduction. One read of the device values, at the measurement step.
        if self.last_gates is None:
            return None
        gates = self.last_gates
        rare = gates.rare
        step_counts = self.counter.newest_step_counts()
        n, g1, g2, tokens, rare_count, alpha = torch.stack([
            rare.sum().double(), torch.where(rare, gates.g1, 0).double().sum(), torch.where(rare, gates.g2, 0).double().sum(),
            step_counts.sum().double(), torch.where(rare, step_counts, 0).sum().double(),
            torch.as_tensor(self.last_alpha, dtype=torch.float64, device=rare.device),
        ]).tolist()  # fmt: skip
        n_rare, nan = int(n), float("nan")
        rare_tokens = rare_count / tokens if tokens else nan
        if not self._rarity_told:
            self._rarity_told = True
            per = (f"per {self.config.alpha_tokens} target tokens (this run: {self.counter.tokens_per_step():.0f} per "
                   "update)" if self.config.alpha_tokens else "per update")  # fmt: skip
            logger.info(
                "AGG at step %d: %d of %d ids are rare (%.1f%% of the vocabulary, a_k < alpha=%g %s), %.1f%% of the "
                "step's target tokens",
                step.step, n_rare, rare.numel(), 100.0 * n_rare / rare.numel(), alpha, per, 100.0 * rare_tokens,
            )  # fmt: skip
        return {
            **({"agg/alpha": alpha} if self.config.rare_fraction is not None else {}),
            "agg/rare_size": float(n_rare),
            "agg/rare_vocab_fraction": n_rare / rare.numel(),
            "agg/rare_target_fraction": rare_tokens,
            "agg/g1_mean_rare": g1 / n_rare if n_rare else nan,
            "agg/g2_mean_rare": g2 / n_rare if n_rare else nan,
            "agg/counter_bytes": float(self.counter.nbytes),
        }

    @hookimpl
    def aniso_state_dict(self) -> dict[str, dict[str, torch.Tensor]] | None:
        if self.counter is None:
            return None
        state = self.counter.state_dict()
        if self._static is not None:
            state["static_appearance"] = self._static[0]
            state["static_steps"] = torch.tensor([self._static[1]], dtype=torch.int64)
            state["static_appearance"] = self._static[0].cpu()
            if self._static[2] is not None:
                state["static_alpha"] = torch.as_tensor(self._static[2], dtype=torch.float64).reshape(1).cpu()
        return {NAMESPACE: state}

    @hookimpl
    def aniso_load_state_dict(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        mine = state.get(NAMESPACE)
        if mine is None:
            return
        current = self._ready()
        counter = SlidingTokenCounter(
            current.vocab_size, current.window, always_frequent=current.always_frequent, ignore_index=current.ignore_index,
            device=current.device,
        )
        counter.load_state_dict(mine)  # raises before anything is replaced
        saved_window = int(mine["window"][0])
        if saved_window != counter.window:
            logger.warning(
                "AGG: the saved token counter has window K=%d, this run K=%d (the epoch length changed with the "
                "batch size, the number of ranks or the gradient accumulation, or window= did): it keeps the last "
                "%d completed steps, exactly the counts a K=%d run would hold",
                saved_window,
                counter.window,
                counter.window - 1,
                counter.window,
            )
        static = None
        if "static_appearance" in mine:
            alpha = float(mine["static_alpha"][0]) if "static_alpha" in mine else None
            static = (mine["static_appearance"].to(counter.device, torch.float32), int(mine["static_steps"][0]), alpha)
        self.counter, self._static, self._counted_step = counter, static, None

    # --- internals ------------------------------------------------------------------------------
    def _check_head_in_place(self) -> None:
        current = self.model.head()
        if current is not self.head.module:
            raise SetupError(
                f"AGG gates the LM head it set up ({type(self.head.module).__name__}), but the model's head is now a "
                f"{type(current).__name__}: something replaced it after AGG's set-up (e.g. a second AnisoCallback "
                "with head=...). Put every option in one AnisoConfig (AnisoConfig(method='agg', head='lowrank', ...)) "
                "so the head is replaced first and AGG gates the new one"
            )

    def _check_consumed(self, step: StepInfo) -> None:
        """A micro-batch AGG was announced must have run through the gated head."""
        if not self.head.armed:
            return
        self._check_head_in_place()
        raise SetupError(
            f"AGG: step {step.step}'s micro-batch was announced, but the LM head's gated forward did not run on it "
            "(the head ran in eval mode, without gradients, or not at all), so its weight gradient was not gated. "
            "AGG needs the training forward to call the model's LM head"
        )

    def _ready(self) -> SlidingTokenCounter:
        if self.counter is None:
            raise RuntimeError("AGG: no token counter yet (the adapter must call TrainingSession.begin_training first)")
        return self.counter

    def _appearance(self, counter: SlidingTokenCounter) -> torch.Tensor:
        """a_k per update (the paper), or per ``alpha_tokens`` target tokens."""
        tokens = self.config.alpha_tokens
        return counter.appearance() if tokens is None else counter.appearance_per_tokens(tokens)

    def _alpha(self, counter: SlidingTokenCounter, appearance: torch.Tensor) -> float | torch.Tensor:
        """α: ``alpha`` (0.03 if None), or under ``rare_fraction`` the one chosen from the window's
        counts (docs/methods.md §1.2; a 0-dim tensor on the device); the frozen one under
        ``agg_static_after``."""
        c = self.config
        if self._static is not None and self._static[2] is not None:
            return self._static[2]
        if c.rare_fraction is None:
            return DEFAULT_ALPHA if c.alpha is None else c.alpha
        return rare_fraction_alpha(counter.counts(), appearance, c.rare_fraction, counter.always_frequent_ids)[0]

    def _gates(self, counter: SlidingTokenCounter) -> RowGates:
        c = self.config
        appearance, steps = self._static[:2] if self._static else (self._appearance(counter), counter.steps_in_window)
        alpha = self.last_alpha = self._alpha(counter, appearance)
        if c.rare_fraction is not None and counter.always_frequent:  # a_k = 1 marks the specials: never rare,
            marker = torch.clamp(torch.as_tensor(alpha, dtype=appearance.dtype, device=appearance.device), min=1.0)
            appearance = appearance.index_put((counter.always_frequent_ids,), marker)  # also where α > 1
        return agg_gates(
            appearance,
            alpha,
            steps=steps,
            g1=c.agg_g1,
            g2=c.agg_g2,
            parts=c.agg_parts,
            freeze_rare=c.agg_freeze_rare,
        )

    def _check_gating(self, counter: SlidingTokenCounter, step: StepInfo) -> None:
        """Once the window is full (the step ending is the K-th in it), warn once when the rare
        group holds none of the window's target tokens, or more than half of them. Checked at the
        step that fills the window and at measurement steps (which read the device anyway), not
        at every step: the share is a read of the counts back to the host."""
        if self._gating_warned or self.last_gates is None or counter.step_index < counter.window:
            return
        if counter.step_index != counter.window and not step.measure:
            return
        counts = counter.counts()
        total, rare_total = torch.stack([counts.sum(), torch.where(self.last_gates.rare, counts, 0).sum()]).tolist()
        share = rare_total / total if total else None
        wanted = self.config.rare_fraction
        if share is None or 0.0 < share <= 0.5 or (share > 0.5 and wanted is not None and wanted > 0.5):
            return
        self._gating_warned = True
        group = step.batch_group if step.batch_group is not None else world_group()
        if is_distributed() and dist.get_rank(group) != 0:
            return  # every rank holds the same counts: the first of the batch says it
        message = self._gating_message(counter, counts, share, step)
        logger.warning(message)
        warnings.warn(message, AGGGatingWarning, stacklevel=2)

    def _gating_message(self, counter: SlidingTokenCounter, counts: torch.Tensor, share: float, step: StepInfo) -> str:
        c, rare, alpha, total = self.config, self.last_gates.rare, float(self.last_alpha), int(counts.sum())
        seen = int((counts[rare] > 0).sum())
        what = "no target token" if share == 0 else "more than half of the target tokens"
        how = "set by alpha" if c.alpha is not None else "the default of alpha=None"
        how = f"chosen by rare_fraction={c.rare_fraction}" if c.rare_fraction is not None else how
        per = f"per alpha_tokens={c.alpha_tokens} target tokens" if c.alpha_tokens else "per update (alpha_tokens=None)"
        text = (f"AGG gates {what} of its window at step {step.step}: with the window full (window={counter.window} "
                f"optimizer steps, {total:,} target tokens seen), the rare group a_k < alpha={alpha:.4g} ({how}; a_k "
                f"counted {per}) holds {int(rare.sum())} of {rare.numel()} ids, {seen} of them "
                f"seen in the window: {share:.1%} of the window's target tokens.")  # fmt: skip
        if share == 0 and c.alpha_tokens and total * alpha <= c.alpha_tokens:
            text += (f" A window of at most alpha_tokens / alpha = {c.alpha_tokens / alpha:,.0f} target tokens "
                     "cannot make a seen id rare.")  # fmt: skip
        elif share == 0 and not c.alpha_tokens and counter.window * alpha <= 1:
            text += f" A window of at most 1 / alpha = {1 / alpha:.4g} optimizer steps cannot make a seen id rare."
        return f"{text} {self._gating_fix(counter, counts)}"

    def _gating_fix(self, counter: SlidingTokenCounter, counts: torch.Tensor) -> str:
        """The setting that would gate about SUGGESTED_FRACTION (or the configured rare_fraction)."""
        c = self.config
        wanted = SUGGESTED_FRACTION if c.rare_fraction is None else c.rare_fraction
        alpha, share = (float(x) for x in rare_fraction_alpha(counts, self._appearance(counter), wanted,
                                                               counter.always_frequent_ids))
        if share == 0 or c.rare_fraction is not None:
            return (f"This window's counts are too coarse for any alpha to make about {100 * wanted:g}% of its target "
                    f"tokens rare (the nearest share is {share:.1%}): use a longer window (window=).")  # fmt: skip
        keep = f" with alpha_tokens={c.alpha_tokens}" if c.alpha_tokens else ""
        return (f"rare_fraction={wanted} (instead of alpha) would gate about {100 * wanted:g}%: alpha is then chosen from "
                f"the token counter at every step; on this window it would be alpha={alpha:.4g}{keep}, gating "
                f"{share:.1%} of the target tokens (docs/methods.md §1.2).")  # fmt: skip


__all__ = ["AGGGatingWarning", "AGGPlugin"]
