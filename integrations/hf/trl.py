"""TRL's trainers under `aniso_plugins.integrations.hf.AnisoCallback` (TRL builds on
``transformers.Trainer``; ``pip install "aniso-plugins[trl]"``).

TRL's ``SFTTrainer`` patches the model's forward (``trl.trainer.utils.add_fused_lm_head``,
after ``Trainer.__init__``, so after the callback's set-up) and trains on
``model(..., fused_lm_head=True)``: the per-token log-probabilities computed in chunks straight
from ``lm_head.weight``, without running the LM head module, where every method acts. Where a
plugin acts there, `route_through_head` turns a fused call into the model's own forward, through
its head, and returns TRL's ``FusedCausalLMOutput``:

    log_probs[n] = log softmax(z_n)[y_n] (with its gradient),   entropy[n] = −Σ_v p_nv log p_nv,
    is_top1[n] = [argmax_v z_nv = y_n],   label_mask[n] = [y_n ≠ −100]   (zero where y_n = −100),
    loss = −Σ_n log_probs[n] / (num_items_in_batch or Σ_n label_mask[n]) (+ the MoE aux term),

with TRL's alignment (``z = logits[:, :-1]``, ``y = labels[:, 1:]``; ``shift_labels`` as
given), computed by the head chunk by chunk (the fused loss's token outputs: the logits are never
held) or, where the head cannot answer, from its logits. Where SFTTrainer computes the loss from
the model's logits itself (a ``compute_loss_func``; label smoothing), its fused call only feeds
TRL's metrics, without gradients, and stays TRL's. TRL's other trainers (DPO, GRPO, KTO, RLOO,
...) build their labels inside the loss and score them with TRL's head: their micro-batches are
announced at the policy's fused calls (`announce_fused_calls`), for the metrics; the methods are
refused (`head_bypassed`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from aniso_plugins import LogitTransform
from aniso_plugins.models.causal_loss import fused_token_outputs

logger = logging.getLogger("aniso_plugins.hf")

_ENTROPY_ROWS = 4096
"""Rows of logits per chunk of the gradient-free entropy and top-1 (one chunk of float32
probabilities at a time, not a second N × V tensor)."""


def is_trl_trainer(trainer: object) -> bool:
    """Whether `trainer` is one of TRL's trainers (a class of its MRO comes from ``trl``)."""
    return any(c.__module__.split(".")[0] == "trl" for c in type(trainer).__mro__)


TRL_FLOOR = (1, 16)
"""The oldest TRL whose trainers the adapter supports (the one tested): TRL 1.9's SFTTrainer
computes its loss from ``lm_head.weight`` by another route, which the methods never see; 1.10 to
1.15 are untested."""


def unsupported_version(trainer: object) -> str | None:
    """Why `trainer`, one of TRL's trainers, cannot be used with the installed TRL (older than
    `TRL_FLOOR`); None for any other trainer or a supported TRL."""
    if not is_trl_trainer(trainer):
        return None
    import trl

    found = tuple(int(part) for part in trl.__version__.split(".")[:2] if part.isdigit())
    if found >= TRL_FLOOR:
        return None
    return (f"TRL {trl.__version__}'s {type(trainer).__name__} is not supported: aniso_plugins works with TRL's trainers "
            f"from trl {'.'.join(map(str, TRL_FLOOR))} on (pip install 'trl>={'.'.join(map(str, TRL_FLOOR))}'); "
            "transformers' Trainer and its subclasses (Axolotl's AxolotlTrainer) do not need TRL")


def labels_at_fused_call(trainer: object) -> bool:
    """Whether `trainer` is one of TRL's trainers whose batches carry no labels: its loss builds
    them and passes them to the policy's fused calls (DPO, KTO, GRPO, RLOO, ...; not SFTTrainer)."""
    if not is_trl_trainer(trainer):
        return False
    from trl import SFTTrainer

    return not isinstance(trainer, SFTTrainer)


def head_bypassed(trainer: object) -> str | None:
    """`ParallelLayout.head_bypassed` of TRL's trainers other than SFTTrainer (`labels_at_fused_call`),
    whose losses compute their log-probabilities from lm_head.weight with TRL's fused LM head."""
    if not labels_at_fused_call(trainer):
        return None
    return (f"TRL's {type(trainer).__name__} bypasses (its loss computes the log-probabilities from lm_head.weight "
            "with TRL's fused LM head, trl.trainer.utils.add_fused_lm_head): train the methods with TRL's SFTTrainer "
            "or transformers' Trainer; here the metrics that read the weights and the trained tokens run (geometry, "
            "frequency, under_trained, ...)")


def announce_fused_calls(model: nn.Module, announce: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[], None]:
    """Announce each training micro-batch of a `labels_at_fused_call` trainer where its labels
    appear: at each fused call of the policy `model` with gradients, `announce` gets
    ``{"labels": ...}`` (or ``{"shift_labels": ...}``), the targets TRL scores (the completions'
    tokens; −100 elsewhere). Calls without gradients (reference models, old log-probabilities,
    KTO's KL term) train nothing and are not announced. Returns the function that removes the hook."""

    def before(module, args, kwargs):
        if kwargs.get("fused_lm_head") and module.training and torch.is_grad_enabled():
            key = "shift_labels" if kwargs.get("shift_labels") is not None else "labels"
            if kwargs.get(key) is not None:
                announce({key: kwargs[key]})
        return None

    return model.register_forward_pre_hook(before, with_kwargs=True).remove


def _routes_its_loss(trainer) -> bool:
    """Whether SFTTrainer's training loss comes from its fused call (not from the model's
    logits: a ``compute_loss_func``, or label smoothing of the "nll" loss)."""
    smooths = trainer.label_smoother is not None and trainer.args.loss_type == "nll"
    return trainer.compute_loss_func is None and not smooths


SFT_TOKEN_OUTPUTS = ("entropy", "is_top1")
"""The token outputs SFTTrainer's fused calls read besides the log-probabilities (its metrics)."""


def token_outputs(trainer) -> tuple[str, ...] | None:
    """The token outputs of the trainer's chunked loss (`ParallelLayout.token_outputs`): those of
    TRL's SFTTrainer where its training loss comes from its fused call, else None."""
    if not is_trl_trainer(trainer):  # trl may not be installed
        return None
    from trl import SFTTrainer

    return SFT_TOKEN_OUTPUTS if isinstance(trainer, SFTTrainer) and _routes_its_loss(trainer) else None


def route_through_head(model: nn.Module, trainer, session, transform: LogitTransform,
                       head: Callable[[], nn.Module]) -> Callable[[], None]:
    """Make SFTTrainer's fused calls of `model` (the model the Trainer holds: a PEFT model or the
    transformers model) run through its LM head where the session acts there (module docstring).
    Two hooks on `model`, whichever forward TRL and accelerate install under them: before a fused
    call (training with gradients, or evaluation), they drop ``fused_lm_head``, ``labels``,
    ``shift_labels`` and ``num_items_in_batch``, so that the model's own forward runs through its
    head; after it, its output becomes TRL's ``FusedCausalLMOutput``: from the head's per-token
    log-probabilities and token outputs where the head answers TRL's chunked call
    (``session.head_computes_loss``), else from its logits. A training call without gradients
    (TRL's metrics beside a loss computed from the logits) stays TRL's, and so does every training
    call where no plugin acts in the head (TRL's own chunked head). `transform`: the logit
    transform the fused head applied (checked against the forward's); `head`: the LM head module
    (it keeps the token outputs of the call). Returns the function that removes both hooks."""
    config = getattr(model, "config", None)
    coefficient = getattr(config.get_text_config(), "router_aux_loss_coef", 0.0) if config is not None else 0.0
    answered, in_head = session.head_computes_loss, session.uses_head_forward
    calls: list[tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | int | None, bool]] = []

    def before(module, args, kwargs):
        if not kwargs.get("fused_lm_head") or (module.training and not torch.is_grad_enabled()):
            return None
        if not _routes_its_loss(trainer) or (module.training and not in_head):
            return None
        kwargs = dict(kwargs)
        kwargs.pop("fused_lm_head")
        calls.append((kwargs.pop("labels", None), kwargs.pop("shift_labels", None), kwargs.pop("num_items_in_batch", None),
                      answered and module.training))
        return args, kwargs

    def after(module, args, kwargs, outputs):
        if not calls or "fused_lm_head" in kwargs:
            return None
        return _fused_output(outputs, *calls.pop(), transform, head(), coefficient)

    handles = [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]
    if answered:
        logger.info("TRL's fused LM head: aniso_plugins' fused loss answers it through the LM head, chunk by chunk")
    elif in_head:
        logger.info(
            "TRL's fused LM head computes the log-probabilities from lm_head.weight without running the head; "
            "aniso_plugins computes them from the head's logits instead (as transformers.Trainer trains: the logits "
            "are held in memory)"
        )

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove


def _fused_output(outputs, labels: torch.Tensor | None, shift_labels: torch.Tensor | None,
                  num_items_in_batch: torch.Tensor | int | None, chunked: bool, transform: LogitTransform,
                  head: nn.Module, coefficient: float):
    """TRL's ``FusedCausalLMOutput`` of a fused call the model's own forward ran: from the head's
    log-probabilities and token outputs (`chunked`: the head answered TRL's call, never the
    logits) or from its logits; plus the MoE aux term as TRL adds it."""
    from trl.trainer.utils import FusedCausalLMOutput

    if chunked:
        log_probs, extra = fused_token_outputs(outputs.logits, head, transform)
        fields = _fields(log_probs, extra, _targets(labels, shift_labels), shift_labels is None, num_items_in_batch)
    else:
        fields = fused_outputs_from_logits(outputs.logits, labels, shift_labels, num_items_in_batch)
    aux = getattr(outputs, "aux_loss", None)
    if aux is not None:
        fields["loss"] = fields["loss"] + coefficient * aux
    return FusedCausalLMOutput(**fields, aux_loss=aux)


def _targets(labels: torch.Tensor | None, shift_labels: torch.Tensor | None) -> torch.Tensor:
    """Each head position's target: ``shift_labels``, or the labels shifted (the last: none)."""
    if shift_labels is not None:
        return shift_labels
    if labels is None:
        raise ValueError("a fused_lm_head=True call needs labels or shift_labels")
    return F.pad(labels[:, 1:], (0, 1), value=-100)


def _fields(log_probs: torch.Tensor, extra: dict[str, torch.Tensor], targets: torch.Tensor, shifted: bool,
            num_items_in_batch: torch.Tensor | int | None) -> dict[str, torch.Tensor]:
    """TRL's fields from each head position's log-probability and token outputs: zero where the
    target is −100, the last position dropped when the labels were shifted, and the loss."""
    mask = targets.to(log_probs.device) != -100
    fields = {"log_probs": log_probs.masked_fill(~mask, 0.0), "label_mask": mask}
    for name, value in extra.items():
        fields[name] = value & mask if value.dtype == torch.bool else value.masked_fill(~mask, 0)
    if shifted:
        fields = {name: value[:, :-1] for name, value in fields.items()}
    count = fields["label_mask"].sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    fields["loss"] = -fields["log_probs"].sum() / count
    return fields


def fused_outputs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    num_items_in_batch: torch.Tensor | int | None,
) -> dict[str, torch.Tensor]:
    """The fields of TRL's ``FusedCausalLMOutput`` from (B, T, V) logits (module docstring):
    log_probs, entropy, is_top1, label_mask (B, T − 1), or (B, T) with `shift_labels`, and the
    loss. Float32 softmax; the logits are not copied for the shift."""
    targets = _targets(labels, shift_labels)
    flat, y = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).to(logits.device)
    log_probs = -F.cross_entropy(flat.float(), y, ignore_index=-100, reduction="none")
    entropy = torch.zeros_like(log_probs)
    is_top1 = torch.zeros_like(y, dtype=torch.bool)
    with torch.no_grad():
        for start in range(0, flat.shape[0], _ENTROPY_ROWS):
            rows = slice(start, start + _ENTROPY_ROWS)
            logp = torch.log_softmax(flat[rows].float(), dim=-1)
            entropy[rows] = -(logp.exp() * logp).sum(-1)
            is_top1[rows] = flat[rows].argmax(-1) == y[rows]
    shape = targets.shape
    extra = {"entropy": entropy.view(shape), "is_top1": is_top1.view(shape)}
    return _fields(log_probs.view(shape), extra, targets, shift_labels is None, num_items_in_batch)


__all__ = ["SFT_TOKEN_OUTPUTS", "TRL_FLOOR", "announce_fused_calls", "fused_outputs_from_logits", "head_bypassed",
           "is_trl_trainer", "labels_at_fused_call", "route_through_head", "token_outputs", "unsupported_version"]
