"""What every trainer adapter needs between its trainer's events and the hooks.

An adapter translates its trainer's events into calls on one `TrainingSession`:

    session.setup(handle)                         before the optimizer exists / the model is wrapped
    session.begin_micro_batch(targets, ...)       each training micro-batch, before its forward
    (forward: the head's forward hook attaches the loss terms on the micro-batch they are due)
    session.end_step(step)                        after the optimizer step
    session.measure(step)                         at measurement steps, on every rank
    session.eval_targets = targets                each evaluation batch, before its forward
                                                  (the head's output feeds aniso_eval_batch)

The session numbers micro-batches within a step, decides when loss terms are due and attaches
them inside the head's forward (`aniso_plugins.loss.attach_loss`), so adapters hold no such
bookkeeping and no method math.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from torch import nn

from .config import AnisoConfig, ConfigError
from .model import ModelHandle
from .plugins import AnisoPlugins
from .state import check_compatible
from .steps import StepInfo


def causal_targets(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Targets aligned with the logits of a causal LM: position t predicts ``labels[t + 1]``;
    the last position gets `ignore_index` (as transformers' ``ForCausalLMLoss`` pads)."""
    pad = torch.full_like(labels[..., :1], ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)


class TrainingSession:
    """One training run's plugins plus the adapter-side bookkeeping.

    config / plugins: as for `AnisoPlugins`.
    loss_scale: the gradient weight of the loss terms, chosen by the adapter for its
        trainer's data-parallel reduction (1 when gradients are averaged over ranks, as in
        DDP and FSDP2 defaults; 1/world when they are summed, as in torchtitan).
    owns_loss: whether the adapter computes the loss itself and can run the fused AGG
        cross-entropy (``config.agg_fused``); others refuse that setting at construction.
    """

    def __init__(
        self,
        config: AnisoConfig | None = None,
        plugins: Iterable[object] = (),
        loss_scale: float = 1.0,
        owns_loss: bool = False,
    ):
        if config is not None and config.method == "agg" and config.agg_fused and not owns_loss:
            raise ConfigError(
                "agg_fused=True: this trainer adapter does not own the loss, so the fused AGG cross-entropy cannot "
                "run (it does in the torchtitan adapter); AGG runs as the gated LM head here: agg_fused=False"
            )
        self.plugins = AnisoPlugins(config, plugins)
        self.config = self.plugins.config
        self.loss_scale = loss_scale
        self.handle: ModelHandle | None = None
        self.epoch_steps: int | None = None
        self._micro_batch = 0
        self._current: StepInfo | None = None
        self._loss_due = False
        self._hook = None
        self.eval_targets: torch.Tensor | None = None
        """Targets of the evaluation batch being run (set by the adapter, None otherwise): the
        head's output in eval mode is then handed to the plugins with them."""

    # --- set-up -----------------------------------------------------------------------------
    def setup(self, handle: ModelHandle) -> None:
        """Run the plugins' set-up (head surgery) and hook the final head's output so loss
        terms can be attached. Call once, before the optimizer is built."""
        if self.handle is not None:
            raise RuntimeError("TrainingSession.setup was already called for this run")
        self.plugins.setup(handle)
        self.handle = handle
        self._hook = handle.head().register_forward_hook(self._on_head_output)

    def _on_head_output(self, module: nn.Module, args, output: torch.Tensor):
        if not module.training:
            if self.eval_targets is not None:
                self.eval_batch(output, self.eval_targets)
            return None
        if not (self._loss_due and torch.is_grad_enabled()):
            return None
        self._loss_due = False
        return self.plugins.attach_loss_terms(output, self._current, self.loss_scale)

    # --- training ---------------------------------------------------------------------------
    def begin_micro_batch(
        self, targets: torch.Tensor, *, step: int, accumulation_steps: int = 1, measure: bool = False
    ) -> StepInfo:
        """Announce a training micro-batch (targets already aligned with the head's output).

        step: 1-based index of the optimizer step this micro-batch belongs to;
        accumulation_steps: micro-batches in this step (a trainer's last window of an epoch
        may be shorter); measure: whether metrics are measured after this step."""
        if self.handle is None:
            raise RuntimeError("TrainingSession.setup(handle) must run before training")
        if self._current is not None and self._current.step != step:
            self._micro_batch = 0
        info = StepInfo(
            step=step,
            micro_batch=self._micro_batch,
            accumulation_steps=max(accumulation_steps, self._micro_batch + 1),
            measure=measure,
            epoch_steps=self.epoch_steps,
        )
        self._micro_batch += 1
        self._current = info
        self.plugins.targets(targets, info)
        self._loss_due = self.plugins.applies_loss_terms(info)
        return info

    def end_step(self, step: int) -> None:
        """The optimizer step `step` was applied."""
        info = self._current if self._current is not None and self._current.step == step else StepInfo(step=step)
        self.plugins.step_end(info)
        self._micro_batch = 0
        self._loss_due = False

    def measure(self, step: int, kind: str = "train") -> dict[str, float]:
        """Metrics (``aniso/...``) at `step`; collective, identical on every rank."""
        return self.plugins.measure(StepInfo(step=step, measure=True, epoch_steps=self.epoch_steps), kind)

    def eval_batch(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """An evaluation batch: logits and targets aligned with them (`causal_targets`)."""
        self.plugins.eval_batch(logits.detach(), targets)

    # --- state ------------------------------------------------------------------------------
    STATE_FILE = "aniso_state.safetensors"

    def state_dict(self) -> dict:
        """In-memory state for trainers that checkpoint Python objects (Lightning):
        ``{"config": dict, "plugins": {namespace: {key: tensor}}}``."""
        return {"config": self.config.to_dict(), "plugins": self.plugins.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output, refusing one from an incompatible configuration."""
        check_compatible(state["config"], self.config.to_dict(), "checkpointed aniso_plugins state")
        self.plugins.load_state_dict(state["plugins"])

    def save(self, directory: str | os.PathLike) -> str:
        """Write the plugins' state into `directory` (call on one rank); returns the path."""
        path = os.path.join(os.fspath(directory), self.STATE_FILE)
        self.plugins.save(path)
        return path

    def load(self, directory: str | os.PathLike) -> bool:
        """Restore from `directory` if it holds a state file; returns whether it did."""
        path = os.path.join(os.fspath(directory), self.STATE_FILE)
        if not os.path.exists(path):
            return False
        self.plugins.load(path)
        return True


__all__ = ["TrainingSession", "causal_targets"]
