"""Replacement LM heads: the low-rank head W = A·B of seed 001, and merging it back.

A low-rank head saves what ``from_pretrained`` of the original model class loads: its state dict
holds ``weight`` = A·B (`merged_weight`) beside ``A`` and ``B``, and loading a state dict that has
``A`` and ``B`` drops that ``weight`` (the factors are the trained values, restored exactly).
``save_pretrained(state_dict=...)`` of a dict built without ``Module.state_dict()`` (DeepSpeed
ZeRO-3's consolidated weights) gets the same key from `LowRankHead.add_merged_weight`, which
`HeadSurgeryPlugin` registers with the model handle (`ModelHandle.complete_saved_state`).

Untying needs no helper of its own: `ModelHandle.untie()` gives the head an independent copy
of the shared weight and calls the handle's ``on_untie`` callback (the HF adapter's sets
``config.tie_word_embeddings = False`` so that nothing re-ties it); `HeadSurgeryPlugin` calls it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

LOWRANK_INITS: tuple[str, ...] = ("svd", "random")


def _check_rank(rank: object, hidden: int) -> int:
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank < hidden:
        raise ValueError(
            f"rank={rank!r}: a low-rank head needs an integer rank r with 1 <= r < d = {hidden} "
            "(the hidden size); r >= d is no bottleneck, use the ordinary head"
        )
    return rank


class LowRankHead(nn.Module):
    """Output projection with a rank-r weight, W = A·B (seed 001 §3.1, docs/methods.md §10):
    A ∈ R^{V×r}, B ∈ R^{r×d}, r < d, both trainable parameters (``A``, ``B``, and ``bias``
    when the replaced head had one).

    ``forward(input) = F.linear(input, A·B, bias)``, computed as ``(input·Bᵀ)·Aᵀ``: 2N(rd + Vr)
    flops instead of 2NVd. ``weight`` is a read-only property returning the V×d product A·B
    (differentiable), so code that reads ``head.weight`` (metrics, regularizers, fused losses)
    sees the effective matrix and its gradient reaches A and B.

    Its state dict holds ``weight`` = A·B (`merged_weight`, detached) beside ``A``, ``B`` and
    ``bias``, so a saved model loads into the original model class (``lm_head.weight``), and a
    resume restores the factors: `_load_from_state_dict` drops ``weight`` when ``A`` and ``B``
    are there (``load_state_dict(strict=True)`` of a saved low-rank model works). Only where the
    state dict holds ``A`` and ``B`` as ordinary full tensors of this head's shapes; an engine's
    shards (DTensor, ShardedTensor, FSDP1's flat shards, ZeRO-3's placeholders) get no
    ``weight`` there: the full dict handed to ``save_pretrained`` gets it instead
    (`add_merged_weight`). `merge_low_rank` turns the head into an ``nn.Linear`` (a clean export:
    no ``A`` / ``B`` beside the weight).

    A new head is initialised randomly (`reset_parameters`); `from_linear` builds one from an
    existing head."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.rank = _check_rank(rank, in_features)
        self.A = nn.Parameter(torch.empty(out_features, rank, device=device, dtype=dtype))
        self.B = nn.Parameter(torch.empty(rank, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self, std: float | None = None, generator: torch.Generator | None = None) -> None:
        """A, B i.i.d. N(0, s²) with s = (std² / r)^{1/4}, so that the entries of A·B have
        variance std² (the 2024 paper's N(0, 1) factors, rescaled to a usable head).
        Default std: that of ``nn.Linear``'s init, 1/sqrt(3d)."""
        std = 1.0 / math.sqrt(3 * self.in_features) if std is None else std
        factor_std = (std * std / self.rank) ** 0.25
        with torch.no_grad():
            self.A.normal_(0.0, factor_std, generator=generator)
            self.B.normal_(0.0, factor_std, generator=generator)

    @property
    def weight(self) -> torch.Tensor:
        """The effective V×d weight A·B."""
        return self.A @ self.B

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(input, self.B), self.A, self.bias)

    def add_merged_weight(self, state_dict: dict[str, torch.Tensor], prefix: str = "") -> bool:
        """Add ``prefix + "weight"`` = A·B (`merged_weight`) to `state_dict` from its
        ``prefix + "A"`` and ``prefix + "B"``, where both are ordinary full tensors of this head's
        shapes (V×r, r×d) and the key is not there yet; returns whether it added it. Anything
        else (missing factors, an engine's shards or placeholders, DTensors) is left as it is."""
        key = prefix + "weight"
        a, b = state_dict.get(prefix + "A"), state_dict.get(prefix + "B")
        if key in state_dict or not (_plain(a) and _plain(b)):
            return False
        if (tuple(a.shape), tuple(b.shape)) != ((self.out_features, self.rank), (self.rank, self.in_features)):
            return False
        state_dict[key] = merged_weight(a, b)
        return True

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        self.add_merged_weight(destination, prefix)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if prefix + "A" in state_dict and prefix + "B" in state_dict:
            state_dict.pop(prefix + "weight", None)  # A·B, saved for from_pretrained: the factors are loaded
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, bias={self.bias is not None}"

    @classmethod
    def from_linear(
        cls, head: nn.Module, rank: int, init: str = "svd", generator: torch.Generator | None = None
    ) -> LowRankHead:
        """A low-rank head replacing `head` (an ``nn.Linear``-like module with a 2-D ``weight``
        W of shape (V, d) and optionally ``bias``), same dtype and device; its bias Parameter is
        the head's own (not a copy), so a bias the model ties elsewhere stays tied and trained.

        init "svd": the truncated SVD W ≈ U_r S_r V_rᵀ (best rank-r approximation, Eckart–Young),
        split evenly: A = U_r S_r^{1/2}, B = S_r^{1/2} V_rᵀ (float64 SVD). init "random":
        `reset_parameters` with std = the standard deviation of W's entries."""
        weight = getattr(head, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(
                f"{type(head).__name__} has no 2-D `weight`: expected an nn.Linear-like head of shape (vocab, hidden)"
            )
        if init not in LOWRANK_INITS:
            raise ValueError(f"init={init!r}: expected one of {', '.join(LOWRANK_INITS)}")
        vocab, hidden = weight.shape
        bias = getattr(head, "bias", None)
        out = cls(hidden, vocab, _check_rank(rank, hidden), bias=bias is not None, device=weight.device, dtype=weight.dtype)
        if isinstance(bias, nn.Parameter):
            out.bias = bias  # the same Parameter: trained on, and still tied where the model ties it (BERT's)
        with torch.no_grad():
            if bias is not None and out.bias is not bias:
                out.bias.copy_(bias)
            if init == "random":
                out.reset_parameters(std=float(weight.detach().double().std()), generator=generator)
            else:
                u, s, vh = torch.linalg.svd(weight.detach().double(), full_matrices=False)
                root = s[:rank].sqrt()
                out.A.copy_(u[:, :rank] * root)
                out.B.copy_(root.unsqueeze(1) * vh[:rank])
        return out


def _plain(tensor: object) -> bool:
    """An ordinary tensor (or Parameter) holding its full values, not an engine's sharded or
    distributed subclass (DTensor, ShardedTensor) nor a tensor without data (meta)."""
    return type(tensor) in (torch.Tensor, nn.Parameter) and tensor.device.type != "meta"


def merged_weight(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The low-rank head's V×d weight A·B for saving and merging: detached, multiplied in float32
    or wider (float64 stays float64; bf16 / fp16 factors are not rounded before the product),
    returned in A's dtype."""
    wide = torch.promote_types(a.dtype, torch.float32)
    with torch.no_grad():
        return (a.detach().to(wide) @ b.detach().to(wide)).to(a.dtype)


def merge_low_rank(head: LowRankHead) -> nn.Linear:
    """An ordinary ``nn.Linear`` (weight A·B, same bias, dtype, device and requires_grad) with the
    same outputs as `head` (its weight is `merged_weight`, what the head's state dict saves as
    ``weight``): a model without the low-rank head, for code that reads the module rather than a
    saved file."""
    if not isinstance(head, LowRankHead):
        raise TypeError(f"merge_low_rank expects a LowRankHead, got {type(head).__name__}")
    with torch.no_grad():
        weight = merged_weight(head.A, head.B)
        linear = nn.Linear(
            head.in_features, head.out_features, bias=head.bias is not None, device=weight.device, dtype=weight.dtype
        )
        linear.weight.copy_(weight)
        if head.bias is not None:
            linear.bias.copy_(head.bias)
    linear.requires_grad_(head.A.requires_grad)
    return linear


def merge_low_rank_heads(model: nn.Module) -> list[str]:
    """Replace, in place, every `LowRankHead` inside `model` by its `merge_low_rank` Linear;
    returns their submodule paths. Not needed to save a loadable model: a low-rank head's state
    dict already holds ``weight`` = A·B, which ``from_pretrained`` loads (beside ``A`` / ``B``,
    which it reports as unused, and which a resumed run loads into the low-rank head its set-up
    builds again). Merge for a clean export (a file with ``lm_head.weight`` only, no unused keys),
    or to hand the model in memory to code that expects an ``nn.Linear`` head.

    A low-rank head is independent of the input embedding. `HeadSurgeryPlugin` unties the model before
    building it, which (through the handle's ``on_untie``) sets a transformers model's
    ``config.tie_word_embeddings`` to False; a model whose flag is still True (a low-rank head
    built by hand on a tied model) is refused, since its ``tie_weights()`` would tie the merged
    head back to the embedding: set the flag to False first."""
    if isinstance(model, LowRankHead):
        raise TypeError("merge_low_rank_heads: pass the model that owns the head; use merge_low_rank(head) for a head")
    paths = [name for name, module in model.named_modules() if isinstance(module, LowRankHead)]
    config = getattr(model, "config", None)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else None
    if paths and any(getattr(cfg, "tie_word_embeddings", False) for cfg in (config, text)):
        raise ValueError(
            f"{type(model).__name__}.config.tie_word_embeddings is True: from_pretrained would tie the merged "
            "head back to the input embedding; set it to False first (HeadSurgeryPlugin does so when it builds the "
            "low-rank head on a tied model)"
        )
    for path in paths:
        parent, _, child = path.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, merge_low_rank(getattr(owner, child)))
    return paths


__all__ = ["LOWRANK_INITS", "LowRankHead", "merge_low_rank", "merge_low_rank_heads", "merged_weight"]
