"""Which token each LM-head output position is trained to predict, and which positions form one
example: the one rule every consumer of targets uses (the adapters' defaults, the report's text
pass), docs/design.md "Targets".

The rule follows what the model's own loss does (the adapter reads it: a transformers model's
with `aniso_plugins.models.alignment.alignment_of`):

- ``"causal"`` (decoder-only LMs): position t predicts ``labels[t + 1]`` (`causal_targets`), as
  transformers' ``ForCausalLMLoss`` shifts; ``batch["shift_labels"]`` when the collator gives
  them (already aligned, as that loss takes them);
- ``"aligned"`` (masked LMs; labels the data pipeline shifted already, as torchtitan's):
  position t predicts ``labels[t]``;
- ``"seq2seq"`` (encoder-decoders, ``config.is_encoder_decoder``): the decoder's position t
  predicts ``labels[t]`` (the decoder reads ``shift_right(labels)``); the head-side token ids
  and padding mask are the batch's ``decoder_input_ids`` / ``decoder_attention_mask``.

Packed batches (padding-free: several examples in one row, `DataCollatorWithFlattening`) carry
their boundaries in ``seq_idx``, ``cu_seq_lens_q`` or ``position_ids`` restarting per example;
`sequence_ids` turns them into per-position example ids, so that terms and metrics that pair
positions of one example (SimCTG, IntraSim) never pair two examples.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from aniso_plugins.core.errors import SetupError

ALIGNMENTS: tuple[str, ...] = ("causal", "aligned", "seq2seq")

TARGETS_HINT = (
    "pass targets='causal' (position t predicts labels[t+1]), targets='aligned' (labels already aligned with the "
    "logits, as a masked LM's), targets='seq2seq' (an encoder-decoder's decoder labels), or "
    "targets=lambda batch: ... returning the ids aligned with the LM head's output positions"
)


def causal_targets(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Targets aligned with the logits of a causal LM: position t predicts ``labels[t + 1]``;
    the last position gets `ignore_index` (as transformers' ``ForCausalLMLoss`` pads)."""
    pad = torch.full_like(labels[..., :1], ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def sequence_ids(
    shape: torch.Size | tuple[int, ...],
    *,
    position_ids: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    cu_seq_lens: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Per position of a (..., T) batch, the example it belongs to within its row (int64, equal
    ids = one example), or None when the batch carries no example boundaries (then every row is
    one example; a row of one example may also get ids, all equal: nothing is read back to the
    host to tell the two apart).

    From the first of: `seq_idx` (the example index per position, as given), `cu_seq_lens`
    (cumulative example lengths over a batch of one row, FlashAttention's ``cu_seq_lens_q``),
    `position_ids` (a new example starts wherever ``position_ids[t] != position_ids[t-1] + 1``,
    whatever the first position's number). Arguments whose shape does not fit are ignored."""
    shape = tuple(shape)
    ids = None
    if seq_idx is not None and tuple(seq_idx.shape) == shape:
        ids = seq_idx.to(torch.int64)
    elif cu_seq_lens is not None and cu_seq_lens.dim() == 1 and len(shape) >= 1 and math.prod(shape[:-1]) == 1:
        bounds = cu_seq_lens.to(torch.int64)  # (bounds[-1] = T in a well-formed batch; not read back)
        ids = torch.bucketize(torch.arange(shape[-1], device=bounds.device), bounds[1:-1], right=True).view(shape)
    elif position_ids is not None and tuple(position_ids.shape[-1:]) == shape[-1:]:
        positions = position_ids.to(torch.int64).expand(shape) if position_ids.dim() < len(shape) else position_ids
        if tuple(positions.shape) == shape:
            starts = torch.ones(shape, dtype=torch.bool, device=positions.device)
            starts[..., 1:] = positions[..., 1:] != positions[..., :-1] + 1
            ids = starts.to(torch.int64).cumsum(-1) - 1
    return ids


def count_targets(
    targets: torch.Tensor | list[torch.Tensor], vocab_size: int, ignore_index: int = -100, device: torch.device | str | None = None
) -> torch.Tensor:
    """Occurrences of each id in `targets` (one tensor or several), int64 (V,), on `device` (default:
    the targets'): positions equal to `ignore_index` are skipped, any other must lie in [0, V).
    No value is read back to the host: ``index_add_`` (not ``bincount``, which reads the range back
    on CUDA) with the ignored positions sent to a spare bin, and the range checked with
    ``torch._assert_async``; where that check runs at once (CPU tensors) a failure is a
    `ValueError` naming the range found."""
    parts = [targets] if isinstance(targets, torch.Tensor) else list(targets)
    for part in parts:
        if part.dtype.is_floating_point or part.dtype.is_complex or part.dtype == torch.bool:
            raise TypeError(f"targets: expected an integer tensor of token ids, got dtype {part.dtype}")
    device = torch.device(device) if device is not None else parts[0].device if parts else torch.device("cpu")
    flat = torch.cat([p.detach().reshape(-1).to(device, torch.int64) for p in parts]) if parts else \
        torch.zeros(0, dtype=torch.int64, device=device)
    valid = flat != ignore_index
    message = f"targets: ids must be in [0, {vocab_size}) or equal ignore_index={ignore_index}"
    try:
        torch._assert_async((((flat >= 0) & (flat < vocab_size)) | ~valid).all(), message)
    except RuntimeError:  # raised at once where the check runs on the host: say what was found
        found = flat[valid]
        raise ValueError(f"{message}; got values in [{int(found.min())}, {int(found.max())}]") from None
    binned = torch.where(valid, flat, vocab_size)  # ignored positions into a spare last bin
    counts = torch.zeros(vocab_size + 1, dtype=torch.int64, device=device)
    return counts.index_add_(0, binned, torch.ones_like(binned))[:vocab_size]


class MicroBatchTargets(NamedTuple):
    """What an adapter hands `aniso_plugins.TrainingSession.begin_micro_batch` for one batch:
    the head-aligned targets (None: the batch has no labels) and, shaped like them, the
    head-side token ids, padding mask and packed-example ids (each None when unknown)."""

    targets: torch.Tensor | None
    input_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    sequence_ids: torch.Tensor | None = None


def _like(x: Any, targets: torch.Tensor) -> torch.Tensor | None:
    return x if isinstance(x, torch.Tensor) and tuple(x.shape) == tuple(targets.shape) else None


def micro_batch_targets(batch: Any, targets: torch.Tensor | None, *, decoder: bool = False) -> MicroBatchTargets:
    """`targets` of the dict-like `batch` with what the batch says of the head's positions,
    each kept only where its shape is the targets': the token ids and padding mask
    (``input_ids`` / ``attention_mask``, or with `decoder` an encoder-decoder's
    ``decoder_input_ids`` / ``decoder_attention_mask``) and, unless `decoder` (a decoder row is
    one example), the packed-example ids (`sequence_ids`)."""
    if targets is None or not isinstance(batch, Mapping):
        return MicroBatchTargets(targets)
    prefix = "decoder_" if decoder else ""
    seq = None
    if not decoder:
        seq = sequence_ids(
            targets.shape,
            position_ids=batch.get("position_ids"),
            seq_idx=batch.get("seq_idx"),
            cu_seq_lens=batch.get("cu_seq_lens_q"),
        )
    ids, mask = batch.get(prefix + "input_ids"), batch.get(prefix + "attention_mask")
    return MicroBatchTargets(targets, _like(ids, targets), _like(mask, targets), seq)


@dataclass(frozen=True)
class LabelAlignment:
    """How a model's loss pairs its LM head's output positions with a batch's ``labels``.

    kind: one of `ALIGNMENTS` (see the module docstring)."""

    kind: str

    def __post_init__(self) -> None:
        if self.kind not in ALIGNMENTS:
            raise SetupError(f"targets={self.kind!r}: expected one of {ALIGNMENTS} or a function of the batch")

    def targets(self, batch: Any, ignore_index: int = -100) -> torch.Tensor | None:
        """The head-aligned targets of a dict-like batch; None when it has no labels."""
        if not isinstance(batch, Mapping):
            return None
        if self.kind == "causal" and batch.get("shift_labels") is not None:
            return batch["shift_labels"]
        labels = batch.get("labels")
        if labels is None:
            return None
        return causal_targets(labels, ignore_index) if self.kind == "causal" else labels

    def read(self, batch: Any, ignore_index: int = -100) -> MicroBatchTargets:
        """The `MicroBatchTargets` of a dict-like batch: `targets`, the head-side token ids and
        padding mask (``input_ids`` / ``attention_mask``; an encoder-decoder's
        ``decoder_input_ids`` / ``decoder_attention_mask``), and the packed-example ids
        (`sequence_ids`; none for an encoder-decoder, whose decoder rows are one example each)."""
        return micro_batch_targets(batch, self.targets(batch, ignore_index), decoder=self.kind == "seq2seq")


@dataclass(frozen=True)
class TargetFunction:
    """A user's ``targets=`` function of the batch (ids aligned with the head's output
    positions) as a target rule: `read` takes the batch's ``input_ids`` / ``attention_mask``
    and packed-example ids where their shape is the targets'."""

    function: Callable[[Any], torch.Tensor]

    def read(self, batch: Any, ignore_index: int = -100) -> MicroBatchTargets:
        return micro_batch_targets(batch, self.function(batch))


TargetRule = LabelAlignment | TargetFunction
"""How an adapter reads a batch's targets: the model's alignment, or the user's function."""


CAUSAL = LabelAlignment("causal")
ALIGNED = LabelAlignment("aligned")
SEQ2SEQ = LabelAlignment("seq2seq")


def target_rule(
    targets: str | Callable[[Any], torch.Tensor] | None, alignment: Callable[[], LabelAlignment] | None
) -> TargetRule:
    """An adapter's ``targets=`` option as a `TargetRule`: a function of the batch, a name of
    `ALIGNMENTS`, or None for `alignment`, called only then: the adapter's reading of its
    model's loss (a transformers model's: `aniso_plugins.models.alignment.alignment_of`), or
    None (`SetupError`) where it has none (a head named by path says nothing of its loss)."""
    if isinstance(targets, (LabelAlignment, TargetFunction)):
        return targets
    if isinstance(targets, str):
        return LabelAlignment(targets)
    if callable(targets):
        return TargetFunction(targets)
    if targets is not None:
        raise SetupError(f"targets={targets!r}: expected one of {ALIGNMENTS}, a function of the batch, or None")
    if alignment is None:
        raise SetupError(f"the LM head was named by path, so its model's loss convention is unknown; {TARGETS_HINT}")
    return alignment()


__all__ = [
    "ALIGNED",
    "ALIGNMENTS",
    "CAUSAL",
    "SEQ2SEQ",
    "LabelAlignment",
    "MicroBatchTargets",
    "TargetFunction",
    "TargetRule",
    "causal_targets",
    "count_targets",
    "micro_batch_targets",
    "sequence_ids",
    "target_rule",
]
