"""Unsupervised SimCSE (Gao, Yao & Chen, EMNLP 2021, "SimCSE: Simple Contrastive Learning of
Sentence Embeddings", §3 eq. 4), docs/methods.md §14.

Every sentence is encoded twice in one training batch; the only difference between the two
views is the dropout mask (the encoder runs in train mode). With z_i, z_i' the pooled
representations of the two views of sentence i of a batch of N sentences, sim the cosine and τ
the temperature (paper: 0.05):

    ℓ_i = −log  exp(sim(z_i, z_i') / τ) / Σ_{j=1..N} exp(sim(z_i, z_j') / τ),    L = mean_i ℓ_i,

i.e. the cross-entropy of the N × N cosine matrix / τ with labels 0..N−1, as the official code
computes it (princeton-nlp/SimCSE, ``simcse/models.py``, ``cl_forward``: z1 the first views,
z2 the second views). The pooled vector is the last encoder layer's hidden state at the first
position ("cls") or its mean over the non-padding positions ("mean", the official "avg").

`SimCSECollator` makes such batches from any collator: it hands each example twice to the base
collator, interleaved, so rows 2i and 2i + 1 of every batch are the same sentence and every
micro-batch (and every data-parallel rank) holds whole pairs. Duplicating *before* the base
collator means a masking collator (``DataCollatorForLanguageModeling(mlm=True)``) masks the two
copies independently.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

POOLINGS = ("cls", "mean")


def _wide(x: torch.Tensor) -> torch.Tensor:
    """`x` in float32, or float64 when it is float64 (bf16 / fp16 activations are widened)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None, pooling: str = "cls") -> torch.Tensor:
    """Sentence vectors (B, d) of the hidden states `hidden` (B, T, d): "cls" takes position 0,
    "mean" the mean over the positions where `attention_mask` (B, T; 1 = token, 0 = padding) is
    nonzero (all positions when it is None; a row without tokens pools to 0). Computed in
    float32 or wider (float64 in, float64 out), autocast off; differentiable."""
    if hidden.dim() != 3:
        raise ValueError(f"pool: expected hidden states (B, T, d), got shape {tuple(hidden.shape)}")
    if pooling not in POOLINGS:
        raise ValueError(f"pool: pooling={pooling!r}: expected one of {', '.join(POOLINGS)}")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(hidden.shape[:2]):
        raise ValueError(
            f"pool: attention_mask {tuple(attention_mask.shape)} does not match the hidden states {tuple(hidden.shape)}"
        )
    if pooling == "cls":
        return _wide(hidden[:, 0])
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        x = _wide(hidden)
        if attention_mask is None:
            return x.mean(dim=1)
        mask = attention_mask.to(device=x.device, dtype=x.dtype).unsqueeze(-1)
        return (x * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)


def info_nce(z1: torch.Tensor, z2: torch.Tensor, temperature: float = 0.05) -> torch.Tensor:
    """SimCSE's InfoNCE loss of the pairs (z1[i], z2[i]) of two (N, d) tensors, N ≥ 1: the mean
    over i of −log softmax_j(cos(z1[i], z2[j]) / τ)[i] (one sentence's first view against the
    second views of the whole batch). A 0-d tensor in float32 (float64 for float64 input),
    autocast off; zero vectors have cosine 0 with everything. Memory O(N²)."""
    if z1.dim() != 2 or z1.shape != z2.shape or z1.shape[0] < 1:
        raise ValueError(
            f"info_nce: expected two (N, d) tensors of one shape, N >= 1, got {tuple(z1.shape)} and {tuple(z2.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"info_nce: temperature={temperature!r}: expected a number > 0")
    with torch.autocast(device_type=z1.device.type, enabled=False):
        u1 = F.normalize(_wide(z1), dim=-1)
        u2 = F.normalize(_wide(z2), dim=-1).to(u1.dtype)
        logits = (u1 @ u2.T) / temperature
        labels = torch.arange(len(logits), device=logits.device)
        return F.cross_entropy(logits, labels)


class SimCSECollator:
    """A collator that hands each example of a batch twice to `base` (any callable on a list of
    features: ``DataCollatorWithPadding`` for pure SimCSE, ``DataCollatorForLanguageModeling``
    for SimCSE + MLM), interleaved: rows 2i and 2i + 1 of the result are example i. The copy is
    shallow (a masking collator builds new tensors, so the two copies are masked
    independently). Trainer-agnostic: pass it as the DataLoader's ``collate_fn`` or the HF
    Trainer's ``data_collator``."""

    def __init__(self, base: Callable[[list[Any]], Any]) -> None:
        if not callable(base):
            raise TypeError(f"SimCSECollator: base must be a collator (a callable on a list of features), got {base!r}")
        self.base = base

    def __call__(self, features: Iterable[Any]) -> Any:
        doubled: list[Any] = []
        for feature in features:
            doubled += [feature, copy.copy(feature)]
        return self.base(doubled)

    def __repr__(self) -> str:
        return f"SimCSECollator({self.base!r})"


__all__ = ["POOLINGS", "SimCSECollator", "info_nce", "pool"]
