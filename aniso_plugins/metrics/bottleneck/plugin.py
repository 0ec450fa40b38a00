"""Gradient-bottleneck probe (Godey & Artzi 2026; `aniso_plugins.metrics.bottleneck.probe`): lost fraction and
kept cosine of the LM head's logit gradients on one training micro-batch, and optionally the
update efficiency through the head (``config.update_efficiency``; docs/methods.md §9.5).

On the first micro-batch of every ``config.bottleneck_every``-th optimizer step (else every
``config.metrics_every``-th, else every step announced with ``measure=True``), hooks on the head
record, without changing any value or gradient:

- forward pre-hook: the head input h is replaced by a view of itself, so that a tensor hook on
  that view receives the head's own contribution dh_i = c·Wᵀg_i (even if h feeds other modules);
- forward hook: this rank's rows of the weight the head used give a local d×d Gram (summed
  across ranks at the measurement: the full WᵀW of the pre-step head, also under FSDP2);
- tensor hook on the logits: ‖c·g_i‖² per position (`squared_row_norms`; positions without a
  loss have g_i = 0 and are skipped);
- tensor hook on the input view: dh_i, kept (float32, or float64 if the gradient is) until the
  measurement.

Update efficiency: `aniso_targets` draws k = ``config.update_efficiency_positions`` positions
with a loss (uniformly, a generator seeded by rank and step); the forward hook keeps their
logits Z (k×V) and a reference to the weight that forward used (under FSDP2 the unsharded
tensor, valid again when the head's backward runs; A and B of a low-rank head), the logits hook
their rows of G = c·(softmax − e_y), and the input-view hook turns their dh rows into
P = dh·Wᵀ (2kVd flops) and drops the weight. Z, G and P (3kV floats, float32) are kept until the
measurement: round 0 pools ‖Z‖², ‖G‖², ‖P‖², ⟨G, P⟩, Σ CE and the count, round 1 the perturbed
losses from the pooled norms (`aniso_plugins.metrics.bottleneck.probe.update_efficiency_stats`): 1 + 2·|ε|
float64 log-sum-exps over k×V, ``LOGIT_ELEMENTS`` entries at a time (docs/methods.md §9.5 gives
the measured cost). G is the gradient the trainer's loss gives the logits: the rows of all ranks
share one scale when that loss weighs every token alike (HF's token mean across devices).

Hooks on the module (not a replaced ``forward``) keep working when another plugin overrides the
head's ``forward`` (AGG), whose hidden-state gradient is the ordinary one. Cost: one Gram
(2Vd²/world flops) in the forward, a pass over the logits gradient, N·d floats of memory, and at
the measurement one d×d eigen-decomposition and N·d² flops. The probe needs logits of width V
as the head's output and a head input that requires grad; otherwise that micro-batch records
nothing. Metrics are reported at the next measurement as ``bottleneck/<metric>``
(`aniso_plugins.metrics.bottleneck.probe.bottleneck_finish`) and ``bottleneck/update_efficiency/<metric>``
(`aniso_plugins.metrics.bottleneck.probe.update_efficiency_finish`), pooled over the ranks' probe positions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from aniso_plugins.core.config import AnisoConfig
from aniso_plugins.core.hookspecs import hookimpl
from aniso_plugins.core.model import ModelHandle
from aniso_plugins.core.plugin_base import Plugin
from aniso_plugins.core.plugins import logger
from aniso_plugins.core.steps import StepInfo
from aniso_plugins.methods.heads.lowrank import LowRankHead
from aniso_plugins.metrics.bottleneck.probe import (
    bottleneck_finish,
    bottleneck_stats,
    hidden_logit_direction,
    sample_loss_positions,
    squared_row_norms,
    update_efficiency_finish,
    update_efficiency_loss_stats,
    update_efficiency_stats,
)
from aniso_plugins.numerics.distributed import local_rows, rank_and_world
from aniso_plugins.numerics.host_copy import to_host
from aniso_plugins.numerics.linalg import gram_stats_blocked
from aniso_plugins.numerics.reduce import Stat

PREFIX = "bottleneck/"
EFFICIENCY = PREFIX + "update_efficiency/"
SEED_STRIDE = 1_000_003
"""Sampling seed of the update-efficiency positions: SEED_STRIDE · step + rank."""


def _head_factors(module: nn.Module) -> tuple[torch.Tensor, ...] | None:
    """The matrices whose product is the head's weight as this forward uses it, detached
    (plain tensors: ``(W,)``, or ``(A, B)`` of a low-rank head); None for a DTensor or no
    2-D weight."""
    from torch.distributed.tensor import DTensor

    factors = (module.A, module.B) if isinstance(module, LowRankHead) else (getattr(module, "weight", None),)
    if any(not isinstance(f, torch.Tensor) or isinstance(f, DTensor) or f.dim() != 2 for f in factors):
        return None
    return tuple(f.detach() for f in factors)


class BottleneckPlugin(Plugin):
    """Probe of the LM-head gradient bottleneck on one micro-batch per probe step."""

    acts_in_head_forward = True  # it reads the training logits and their gradient there

    name = "bottleneck"

    def __init__(self, config: AnisoConfig) -> None:
        super().__init__(config)
        self.every = config.bottleneck_every or config.metrics_every
        self.ignore_index = config.ignore_index
        self.efficiency = config.update_efficiency
        self.eps = tuple(dict.fromkeys(config.update_efficiency_eps))
        self.positions = config.update_efficiency_positions
        self.vocab_size = 0
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self._armed = False
        self._input: torch.Tensor | None = None
        self._gram: torch.Tensor | None = None
        self._grad_sq: torch.Tensor | None = None
        self._probe: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # update efficiency: (index, targets, positions) of the sampled rows, then Z, G, the weight
        self._rows: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self._logit_rows: torch.Tensor | None = None
        self._grad_rows: torch.Tensor | None = None
        self._factors: tuple[torch.Tensor, ...] | None = None
        self._efficiency: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._warned: set[str] = set()

    @hookimpl
    def aniso_reads_training_logits(self) -> str:
        return "the gradient-bottleneck probe reads the training logits and their gradient"

    def setup(self, model: ModelHandle) -> None:
        head = model.head()
        self.vocab_size = model.vocab_size
        self.handles = [head.register_forward_pre_hook(self._pre_forward), head.register_forward_hook(self._forward)]
        for handle in self.handles:
            model.on_restore(handle.remove)
        if self.efficiency:
            model.register_logits_hook(self._check_final_logits)

    def due(self, step: StepInfo) -> bool:
        """Whether `step` is a probe step (see the module docstring)."""
        return step.step % self.every == 0 if self.every else step.measure

    @hookimpl
    def aniso_targets(self, targets: torch.Tensor, step: StepInfo) -> None:
        self._armed = step.micro_batch == 0 and self.due(step)
        self._rows = self._logit_rows = self._grad_rows = self._factors = None
        if self._armed and self.efficiency:  # the head's first call sees the first chunk
            first = targets.chunk(step.head_calls, dim=-1)[0] if step.head_calls > 1 else targets
            generator = torch.Generator().manual_seed(SEED_STRIDE * step.step + rank_and_world()[0])
            index = sample_loss_positions(first, self.positions, generator, self.ignore_index)
            self._rows = (index, first.reshape(-1)[index], first.numel())

    def _pre_forward(self, module: nn.Module, args: tuple):
        if not (self._armed and torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor)):
            return None
        if not args[0].requires_grad:
            return None
        self._input = args[0].view_as(args[0])
        return (self._input, *args[1:])

    def _forward(self, module: nn.Module, args: tuple, output) -> None:
        # the input the pre-hook armed, or an engine's stand-in for it (ZeRO-3's pre-forward hook,
        # registered after ours, passes each input through an autograd function of its own)
        if self._input is None or not args or not isinstance(args[0], torch.Tensor) or args[0].shape != self._input.shape:
            return
        hidden, self._input = self._input, None
        self._armed = False
        logits = isinstance(output, torch.Tensor) and output.dim() >= 1 and output.shape[-1] == self.vocab_size
        if not (logits and output.requires_grad):  # e.g. a head that returned the fused loss
            return
        self._gram = gram_stats_blocked(local_rows(module.weight.detach()).rows).gram
        if self._rows is not None:
            self._keep_logits(module, output)
        output.register_hook(self._on_logits_grad)
        hidden.register_hook(self._on_input_grad)

    def _keep_logits(self, module: nn.Module, output: torch.Tensor) -> None:
        """Update efficiency: this forward's sampled logit rows and the weight it used."""
        index, _, positions = self._rows
        flat = output.detach().reshape(-1, output.shape[-1])
        factors = _head_factors(module)
        why = None
        if factors is None:
            why = "the head's weight is not a plain 2-D tensor in its forward (a DTensor, or no `weight`)"
        elif flat.shape[0] != positions:
            why = f"the head returned {flat.shape[0]} rows of logits for {positions} targets"
        if why is not None:
            self._warn_once("input", "aniso_plugins bottleneck: no update efficiency on this probe: %s", why)
            self._rows = None
            return
        rows = flat.index_select(0, index.to(flat.device))
        self._logit_rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
        self._factors = factors

    def _check_final_logits(self, logits: torch.Tensor) -> None:
        """Update efficiency perturbs the cross-entropy of the head's logits: a model that changes
        them before its loss (a logit bias, a soft-cap) gets no value for this probe, with a warning."""
        if self._logit_rows is None or logits.shape[-1] != self._logit_rows.shape[-1]:
            return
        flat = logits.detach().reshape(-1, logits.shape[-1])
        if flat.shape[0] != self._rows[2]:
            return
        rows = flat.index_select(0, self._rows[0].to(flat.device)).to(self._logit_rows.dtype)
        if not torch.equal(rows, self._logit_rows):
            self._warn_once(
                "transform",
                "aniso_plugins bottleneck: no update efficiency: the model changes the head's logits before its loss "
                "(a logit bias or soft-cap), and the metric perturbs the cross-entropy of the head's own logits",
            )
            self._logit_rows = None

    def _on_logits_grad(self, grad: torch.Tensor) -> None:
        flat = grad.detach().reshape(-1, grad.shape[-1])
        self._grad_sq = squared_row_norms(flat)
        if self._logit_rows is not None:
            rows = flat.index_select(0, self._rows[0].to(flat.device))
            self._grad_rows = rows.to(torch.promote_types(rows.dtype, torch.float32))

    def _on_input_grad(self, grad: torch.Tensor) -> None:
        dh = grad.detach().reshape(-1, grad.shape[-1])
        dh = dh.to(torch.promote_types(dh.dtype, torch.float32), copy=True)
        if self._grad_sq is not None and self._gram is not None and self._grad_sq.shape[0] == dh.shape[0]:
            self._probe = (self._gram, dh, self._grad_sq)
            if self._grad_rows is not None and self._factors is not None:
                index, targets, _ = self._rows
                rows = dh.index_select(0, index.to(dh.device))
                if len(self._factors) == 2:  # W = A·B: P = (dh·Bᵀ)·Aᵀ
                    rows = rows @ self._factors[1].to(rows.dtype).T
                direction = hidden_logit_direction(rows, self._factors[0])
                self._efficiency = (self._logit_rows, self._grad_rows, direction, targets.to(direction.device))
        self._gram = self._grad_sq = None
        self._rows = self._logit_rows = self._grad_rows = self._factors = None

    def _efficiency_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Z, G, P and targets of this rank's sampled positions (none: empty, same names)."""
        if self._efficiency is not None:
            return self._efficiency
        device = self._probe[0].device
        empty = torch.zeros(0, self.vocab_size, device=device)
        return empty, empty, empty, torch.zeros(0, dtype=torch.long, device=device)

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)

    def train_stats(self, step: StepInfo, round_index: int, reduced: Mapping[str, torch.Tensor]) -> dict[str, Stat] | None:
        if self._probe is None:
            return None
        gram, dh, grad_sq = self._probe
        if round_index == 0:  # the head's WᵀW, summed over the ranks' rows; update-efficiency norms
            stats = {PREFIX + "gram": Stat(gram)}
            if self.efficiency:
                stats.update(update_efficiency_stats(*self._efficiency_rows(), prefix=EFFICIENCY))
            return stats
        if round_index == 1:  # the probe positions' kept and lost parts, from the full WᵀW
            stats = bottleneck_stats(dh, grad_sq, reduced[PREFIX + "gram"], PREFIX)
            if self.efficiency:  # perturbed losses, steps from the pooled norms
                stats.update(update_efficiency_loss_stats(*self._efficiency_rows(), self.eps, reduced, EFFICIENCY))
            return stats
        return None

    def train_metrics(self, step: StepInfo, reduced: Mapping[str, torch.Tensor]) -> dict[str, float] | None:
        if self._probe is None:
            return None
        self._probe = self._efficiency = None
        finishing = [PREFIX + name for name in ("tokens", "grad_sq", "kept_sq", "kept_cosine", "kept_ratio")]
        # the measurement's one read: the probe's sums (not its d × d Gram) and the efficiency's
        reduced = to_host({k: v for k, v in reduced.items() if k in finishing or k.startswith(EFFICIENCY)})
        out = {PREFIX + name: value for name, value in bottleneck_finish(reduced, PREFIX).items()}
        if self.efficiency:
            metrics = update_efficiency_finish(reduced, self.eps, EFFICIENCY)
            bad = sorted(name for name, value in metrics.items() if math.isnan(value))
            if bad and metrics["tokens"] > 0:
                self._warn_once(
                    "nonfinite",
                    "aniso_plugins bottleneck: update efficiency %s is NaN at step %d (non-finite logits or gradients, "
                    "or a zero norm: no step to take); reported as NaN, training goes on",
                    ", ".join(bad),
                    step.step,
                )
            out.update({EFFICIENCY + name: value for name, value in metrics.items()})
        return out


__all__ = ["BottleneckPlugin"]
