"""Self-similarity, intra-sentence similarity and the anisotropy baseline of one layer's token
representations (Ethayarajh, EMNLP 2019, "How Contextual are Contextualized Word
Representations?": the measures of contextuality and their anisotropy adjustment), raw and
anisotropy-adjusted; docs/methods.md §7.1.

With f(s, i) the layer's representation of position i of sentence s (a sequence of the
micro-batch) and u = f/‖f‖ (zero vectors skipped):

    SelfSim(w)   = 1/(n² − n) Σ_j Σ_{k≠j} cos(f(s_j, i_j), f(s_k, i_k))  over the n ≥ 2 occurrences of w
                 = (‖S_w‖² − n_w) / (n_w² − n_w),                 S_w = Σ_{occurrences of w} u
    IntraSim(s)  = 1/n Σ_i cos(s̄, f(s, i)) = s̄ᵀ(Σ_i u_i) / (‖s̄‖ n),  s̄ = mean_i f(s, i)
    baseline     = mean cos(u_j, u_k) over ordered pairs of occurrences of different words
                 = (‖S‖² − Σ_w ‖S_w‖²) / (n² − Σ_w n_w²),          S = Σ_w S_w
    adjusted     = raw − baseline  (SelfSim averaged over the measured words, IntraSim over sentences)

Exact over the data-parallel ranks with sums only: every rank knows the **global** token counts
before the forward (`word_counts`, summed across ranks), so all ranks choose the same word set
(`choose_words`: at most ``cap`` of the repeated tokens, most frequent first) and sum per layer,
per slot, the unit vectors: one row per chosen word, one for the repeated words beyond the cap
("O"), one for the words seen once. A word seen once contributes ‖u‖² = 1 to Σ_w ‖S_w‖²; a word
of O has no S_w of its own, so the baseline leaves out exactly the pairs with **both** words in O
(all of them when the cap covers every repeated word; `baseline_pair_share` says how many pairs
are kept). Memory: (cap + 2) × d float64 per layer, plus a V-vector of counts.

Three steps, as `aniso_plugins.metrics.geometry.stats`: `layer_stats` (local sums) -> `reduce_stats` ->
`layer_finish` (identical on every rank).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import torch

from aniso_plugins.numerics.reduce import Stat

BLOCK_ROWS = 8192
"""Positions converted to float64 at a time."""

METRICS = ("self_sim", "self_sim_adjusted", "intra_sim", "intra_sim_adjusted", "baseline")
"""What `layer_finish` returns for each layer."""


class WordSet(NamedTuple):
    """The words measured, identical on every rank (from the global counts).

    words: the chosen repeated token ids, most frequent first (ties: smaller id first);
    slots: (V,) int64, the sum row of each id: i for ``words[i]``, ``len(words)`` for a
        repeated id beyond the cap, ``len(words) + 1`` for any other id;
    repeated: how many ids occur at least twice (``repeated > len(words)``: the cap binds)."""

    words: torch.Tensor
    slots: torch.Tensor
    repeated: int


def token_positions(
    targets: torch.Tensor,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    sequence_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, counted), both shaped like `targets` ``(..., T)``.

    counted: the positions that belong to their sentence: ``attention_mask != 0`` when a mask of
    that shape is given; else, in a packed batch (`sequence_ids`, which has no padding inside an
    example), every position of an example with a target (what the attention mask of the same
    examples padded says); else ``targets != ignore_index`` (as the hidden-state metric).
    ids: the token whose representation sits at each position, −1 where unknown or not counted:
    `input_ids` when given (same shape), else the causal shift of the targets (the input at
    position t is the target of t − 1; position 0, and positions after an ignored target, are
    unknown). Ids outside ``[0, vocab_size)`` are unknown."""
    if input_ids is not None and tuple(input_ids.shape) != tuple(targets.shape):
        raise ValueError(
            f"input_ids of shape {tuple(input_ids.shape)} do not match the targets' {tuple(targets.shape)}: "
            "pass the micro-batch's own input ids (or None for the causal fallback)"
        )
    if attention_mask is not None and tuple(attention_mask.shape) == tuple(targets.shape):
        counted = attention_mask.to(targets.device) != 0
    elif sequence_ids is not None and tuple(sequence_ids.shape) == tuple(targets.shape):
        rows = targets.reshape(-1, targets.shape[-1])
        seg = sequence_ids.reshape(rows.shape).to(targets.device, torch.int64)
        keys = torch.arange(rows.shape[0], device=rows.device).unsqueeze(1) * rows.shape[1] + (seg - seg.min(-1, keepdim=True).values)
        has_target = torch.zeros(rows.numel(), dtype=torch.bool, device=rows.device)
        has_target[keys[rows != ignore_index]] = True
        counted = has_target[keys].reshape(targets.shape)
    else:
        counted = targets != ignore_index
    if input_ids is not None:
        ids = input_ids.to(targets.device, torch.int64)
    else:
        unknown = torch.full_like(targets[..., :1], -1, dtype=torch.int64)
        previous = targets[..., :-1].to(torch.int64)
        previous = previous.masked_fill(previous == ignore_index, -1)
        ids = torch.cat([unknown, previous], dim=-1)
    known = counted & (ids >= 0)
    if vocab_size is not None:
        known &= ids < vocab_size
    return ids.masked_fill(~known, -1), counted


def word_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(V,) int64 occurrences of each id among the known positions (``ids >= 0``)."""
    known = ids[ids >= 0].reshape(-1)
    return torch.bincount(known, minlength=vocab_size)[:vocab_size]


def choose_words(counts: torch.Tensor, cap: int) -> WordSet:
    """The `WordSet` of the (global) `counts`: the repeated ids (count ≥ 2), the `cap` most
    frequent of them measured individually, ties broken by the smaller id."""
    if cap < 1:
        raise ValueError(f"cap={cap!r}: expected an integer >= 1 (AnisoConfig.ethayarajh_words)")
    counts = counts.reshape(-1)
    order = torch.sort(-counts, stable=True).indices  # by count descending, then id ascending
    repeated = int((counts >= 2).sum())
    words = order[: min(cap, repeated)]
    slots = torch.full_like(counts, len(words) + 1, dtype=torch.int64)
    slots[order[len(words) : repeated]] = len(words)
    slots[words] = torch.arange(len(words), device=counts.device)
    return WordSet(words, slots, repeated)


def baseline_pair_share(counts: torch.Tensor, words: WordSet) -> float:
    """Share of the ordered different-word pairs of occurrences that the baseline keeps: all but
    those with both words repeated beyond the cap (from the counts; zero vectors aside). NaN
    when there are no such pairs."""
    c = counts.reshape(-1).to(torch.float64)
    beyond = c[words.slots == len(words.words)]
    total = c.sum() ** 2 - (c * c).sum()
    left_out = beyond.sum() ** 2 - (beyond * beyond).sum()
    return float(1.0 - left_out / total) if total > 0 else math.nan


def _zeros(k: int, d: int, device: torch.device) -> dict[str, torch.Tensor]:
    f64 = torch.float64
    return {
        "word_sums": torch.zeros(k + 2, d, dtype=f64, device=device),
        "word_counts": torch.zeros(k + 2, dtype=f64, device=device),
        "intra_sum": torch.zeros((), dtype=f64, device=device),
        "intra_count": torch.zeros((), dtype=f64, device=device),
        "nonfinite": torch.zeros((), dtype=f64, device=device),
    }


def empty_layer_stats(words: WordSet, d: int, device: torch.device, prefix: str = "") -> dict[str, Stat]:
    """`layer_stats` of a layer that saw nothing (same names and shapes)."""
    return {prefix + key: Stat(value) for key, value in _zeros(len(words.words), d, device).items()}


def layer_stats(
    hidden: torch.Tensor,
    ids: torch.Tensor,
    counted: torch.Tensor,
    words: WordSet,
    prefix: str = "",
    sentences: torch.Tensor | None = None,
) -> dict[str, Stat]:
    """This rank's sums for one layer (all `Stat` sums).

    hidden: ``(..., T, d)`` representations, one sentence per row of the leading dimensions, or,
    with `sentences` (``(..., T)`` example ids of packed rows, `aniso_plugins.StepInfo.sequence_ids`),
    one sentence per example of a row; ids / counted: ``(..., T)`` from `token_positions`;
    words: the `WordSet` of the global counts.
    Keys: ``word_sums`` ((k + 2) × d, Σ u per slot), ``word_counts`` (nonzero occurrences per
    slot), ``intra_sum`` / ``intra_count`` (Σ IntraSim(s) over the sentences with two or more
    nonzero counted vectors and s̄ ≠ 0, and their number), ``nonfinite`` (counted vectors with
    a NaN or inf entry; positions that do not count are never read)."""
    d, t = hidden.shape[-1], hidden.shape[-2]
    if tuple(hidden.shape[:-1]) != tuple(ids.shape) or tuple(ids.shape) != tuple(counted.shape):
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be (..., T, d) over ids {tuple(ids.shape)} and counted "
            f"{tuple(counted.shape)} of shape (..., T)"
        )
    x = hidden.detach().reshape(-1, t, d)
    device = x.device
    ids, counted = ids.reshape(-1, t).to(device), counted.reshape(-1, t).to(device)
    if sentences is not None:
        if tuple(sentences.shape) != tuple(hidden.shape[:-1]):
            raise ValueError(f"sentences {tuple(sentences.shape)} must have the shape of ids {tuple(hidden.shape[:-1])}")
        sentences = sentences.reshape(-1, t).to(device=device, dtype=torch.int64)
        sentences = sentences - sentences.min(-1, keepdim=True).values  # 0 <= id < T within each row
    slots = words.slots.to(device)
    k = len(words.words)
    acc = _zeros(k, d, device)
    sums = torch.zeros(k + 3, d, dtype=torch.float64, device=device)  # row k + 2: positions without a word
    zero = torch.zeros((), dtype=torch.float64, device=device)
    per_block = max(1, BLOCK_ROWS // max(t, 1))
    for start in range(0, x.shape[0], per_block):
        cb, ib = counted[start : start + per_block], ids[start : start + per_block]
        # positions that do not count are zeroed (padding may hold anything, NaN included)
        xb = torch.where(cb[..., None], x[start : start + per_block].to(torch.float64), zero)
        norm = xb.norm(dim=-1)
        acc["nonfinite"] += (~torch.isfinite(norm)).sum()
        nonzero = cb & (norm != 0)
        u = xb * torch.where(nonzero, norm.reciprocal(), zero)[..., None]
        # intra-sentence similarity: s̄ over the counted positions, cosines of its nonzero vectors
        sb = None if sentences is None else sentences[start : start + per_block]
        mean, unit_sum, n = _sentence_sums(xb, u, nonzero, sb)
        mean_norm = mean.norm(dim=-1)
        keep = (n >= 2) & (mean_norm != 0)
        intra = (mean * unit_sum).sum(-1) / (mean_norm * n)
        acc["intra_sum"] += intra[keep].sum()
        acc["intra_count"] += keep.sum()
        # unit-vector sums per word slot
        slot = torch.where(nonzero & (ib >= 0), slots[ib.clamp_min(0)], k + 2).reshape(-1)
        sums.index_add_(0, slot, u.reshape(-1, d))
        acc["word_counts"] += torch.bincount(slot, minlength=k + 3)[: k + 2].to(torch.float64)
    acc["word_sums"] = sums[: k + 2]
    return {prefix + key: Stat(value) for key, value in acc.items()}


def _sentence_sums(xb: torch.Tensor, u: torch.Tensor, nonzero: torch.Tensor, sentences: torch.Tensor | None):
    """Per sentence: Σ x (the unnormalized s̄), Σ u and the number of nonzero counted vectors.
    One sentence per row of ``(B, T, d)`` `xb`, or with `sentences` (``(B, T)`` ids, 0 ≤ id < T)
    one per (row, example), summed by key row·T + example."""
    if sentences is None:
        return xb.sum(1), u.sum(1), nonzero.sum(1)
    b, t, d = xb.shape
    keys = (torch.arange(b, device=xb.device).unsqueeze(1) * t + sentences).reshape(-1)
    mean = xb.new_zeros(b * t, d).index_add_(0, keys, xb.reshape(-1, d))
    unit_sum = u.new_zeros(b * t, d).index_add_(0, keys, u.reshape(-1, d))
    n = torch.zeros(b * t, dtype=torch.int64, device=xb.device).index_add_(0, keys, nonzero.reshape(-1).long())
    return mean, unit_sum, n


def layer_parts(reduced: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """What `layer_finish` needs of the reduced `layer_stats`, reduced further on their device to
    a few numbers per word (nothing read back): the counts, each slot's ‖Σ u‖², the tracked
    words' s_t·s_t and s_t·s_o, the sentence sums and the non-finite count."""
    sums, counts = reduced[prefix + "word_sums"], reduced[prefix + "word_counts"]
    k = counts.shape[0] - 2
    # tracked words (chosen + seen once) and the repeated words beyond the cap (slot k)
    s_t, s_o = sums[:k].sum(0) + sums[k + 1], sums[k]
    return {"counts": counts, "sq": (sums * sums).sum(1), "tt": s_t @ s_t, "to": s_t @ s_o,
            "intra_sum": reduced[prefix + "intra_sum"], "intra_count": reduced[prefix + "intra_count"],
            "nonfinite": reduced[prefix + "nonfinite"]}


def layer_finish(reduced: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, float]:
    """SelfSim (mean over the chosen words with two or more nonzero occurrences), IntraSim
    (mean over sentences), the baseline, and both adjusted by it (raw − baseline), from the
    reduced `layer_stats`. NaN where undefined (no such word, sentence or pair) and for every
    metric of a layer with non-finite entries."""
    return finish_layer_parts(layer_parts(reduced, prefix))


def finish_layer_parts(parts: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """`layer_finish` from `layer_parts` (read on the host: a measurement copies every layer's
    parts at once, `aniso_plugins.numerics.host_copy.to_host`)."""
    counts, sq = parts["counts"], parts["sq"]
    if float(parts["nonfinite"]) > 0:
        return dict.fromkeys(METRICS, math.nan)
    k = counts.shape[0] - 2
    n_w, sq_w = counts[:k], sq[:k]
    measured = n_w >= 2
    per_word = (sq_w[measured] - n_w[measured]) / (n_w[measured] ** 2 - n_w[measured])
    self_sim = float(per_word.mean()) if per_word.numel() else math.nan
    n_t, n_o, n_once = n_w.sum() + counts[k + 1], counts[k], counts[k + 1]
    pair_sum = parts["tt"] - sq_w.sum() - n_once + 2 * parts["to"]
    pair_count = n_t**2 - (n_w**2).sum() - n_once + 2 * n_t * n_o
    baseline = float(pair_sum / pair_count) if pair_count > 0 else math.nan
    intra_count = float(parts["intra_count"])
    intra = float(parts["intra_sum"]) / intra_count if intra_count > 0 else math.nan
    return {
        "self_sim": self_sim,
        "self_sim_adjusted": self_sim - baseline,
        "intra_sim": intra,
        "intra_sim_adjusted": intra - baseline,
        "baseline": baseline,
    }


__all__ = [
    "BLOCK_ROWS",
    "METRICS",
    "WordSet",
    "baseline_pair_share",
    "choose_words",
    "empty_layer_stats",
    "finish_layer_parts",
    "layer_finish",
    "layer_parts",
    "layer_stats",
    "token_positions",
    "word_counts",
]
