"""One configuration object, shared by every trainer adapter.

`AnisoConfig` is a flat dataclass so that it maps one-to-one onto command-line flags
(torchtitan: ``--aniso.method agg --aniso.alpha 0.03``) and onto keyword arguments
(``AnisoConfig(method="agg", alpha=0.03)``). Fields are grouped by the plugin that reads
them; a plugin ignores the fields of methods that are off. Every value is checked at
construction: a bad one raises `ConfigError` naming the field, the value and what is accepted.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

METHODS = ("none", "agg", "cosreg", "hinge", "spectrum")
HEADS = ("keep", "untie", "lowrank")
METRICS = ("geometry", "frequency", "hidden", "bottleneck", "eval")
AGG_PARTS = ("a", "b", "c")
SPECTRUM_PRIORS = ("poly", "exp", "ratio")


class ConfigError(ValueError):
    """A configuration value is outside its accepted range."""


@dataclass
class AnisoConfig:
    """What to run. Defaults measure geometry and change nothing about training.

    Training method (one of them at a time, compared by switching this field):
        method: "none" (MLE), "agg" (Yu et al. 2022), "cosreg" (Gao et al. 2019),
            "hinge" (pairwise cosine hinge), "spectrum" (Wang et al. 2020).
        head: "keep", "untie" (independent output matrix) or "lowrank" (W = A·B).
        ignore_index: target value that marks positions without a loss.
    """

    method: str = "none"
    head: str = "keep"
    ignore_index: int = -100

    # --- AGG (methods.md §1) -------------------------------------------------------------
    alpha: float = 0.03
    """Rare threshold: token k is rare iff a_k < alpha (strict). Paper: 0.03 LM, 0.08 MT."""
    window: int | None = None
    """K, optimizer steps the token counter remembers. None: one epoch when the adapter knows it."""
    special_ids: tuple[int, ...] = ()
    """Ids with a_k = 1 (never rare), like fairseq's 4 specials."""
    agg_g1: bool = True
    """Ablation: False sets g1 = 1 (no gating for non-rare targets)."""
    agg_g2: bool = True
    """Ablation: False sets g2 = 1 (no gating for rare targets)."""
    agg_static_after: int | None = None
    """Ablation: freeze the rare group (and gates) after this many optimizer steps."""
    agg_freeze_rare: bool = False
    """Ablation: the paper's Freeze experiment, rare rows get no output-side gradient at all."""
    agg_parts: tuple[str, ...] = ("b", "c")
    """Gradient parts of a rare row to gate (methods.md §0): (a) own contexts, (b) non-rare
    targets, (c) other rare targets. Default ("b", "c") is the official AGG."""
    agg_fused: bool = False
    """Run AGG as the fused chunked AGG cross-entropy (no full logits) instead of the gated head:
    only adapters that own the loss can (torchtitan, where it is the default); the HF and
    Lightning adapters refuse it."""
    agg_chunk_size: int = 1024
    """Token rows per chunk of the fused AGG cross-entropy."""

    # --- Regularizers (methods.md §3-4) ---------------------------------------------------
    reg_weight: float = 1.0
    """γ of CosReg, λ of the hinge, λ of spectrum control."""
    reg_every_microbatch: bool = False
    """Apply a regularizer on every micro-batch (weight / accumulation steps) instead of once
    per optimizer step. The two conventions give the same gradient; this one spreads the cost."""
    reg_exclude_ids: tuple[int, ...] = ()
    """Rows left out of the regularizers (e.g. pad and other special ids)."""
    hinge_margin: float = 0.5
    """γ of the hinge: pairs with cos > margin are penalized."""
    hinge_sample: int | None = None
    """Rows sampled per step for the hinge (unbiased estimate); None: exact, blockwise."""
    hinge_block: int = 1024
    """Rows per block of the exact hinge (memory O(block·V))."""
    spectrum_prior: str = "poly"
    """"poly" c1·k^-γ, "exp" c1·exp(-c2·k^γ), or "ratio" (σ1/σd penalty)."""
    spectrum_c1: float | None = None
    """c1 of the prior; None: σ1 of the head at setup."""
    spectrum_c2: float = 0.01
    spectrum_gamma: float = 0.75

    # --- Heads (seed 001) -------------------------------------------------------------------
    lowrank_rank: int | None = None
    """Rank r < d of the low-rank head W = A·B."""
    lowrank_init: str = "svd"
    """"svd" (truncated SVD of the current head) or "random"."""

    # --- Metrics (methods.md §2, §7-9) ----------------------------------------------------
    metrics: tuple[str, ...] = ("geometry",)
    """Metric plugins to run, any of METRICS."""
    metrics_every: int | None = None
    """Optimizer steps between metric measurements; None: at the trainer's logging steps."""
    group_fractions: tuple[float, float, float] = (0.2, 0.5, 0.3)
    """Rare / medium / frequent shares of the vocabulary for frequency groups (AGG seed)."""
    hidden_samples: int = 256
    """Token representations sampled per layer and measurement for hidden-state anisotropy."""
    bottleneck_every: int | None = None
    """Optimizer steps between gradient-bottleneck probes; None: metrics_every."""

    # --- Plugins ----------------------------------------------------------------------------
    load_entry_points: bool = True
    """Load third-party plugins from the ``aniso_plugins`` entry-point group."""

    def __post_init__(self) -> None:
        for name in ("special_ids", "reg_exclude_ids", "agg_parts", "metrics", "group_fractions"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = tuple(v for v in value.replace(",", " ").split() if v)
                if name in ("special_ids", "reg_exclude_ids"):
                    value = tuple(int(v) for v in value)
                elif name == "group_fractions":
                    value = tuple(float(v) for v in value)
            setattr(self, name, tuple(value))
        _choice("method", self.method, METHODS)
        _choice("head", self.head, HEADS)
        _choice("spectrum_prior", self.spectrum_prior, SPECTRUM_PRIORS)
        _choice("lowrank_init", self.lowrank_init, ("svd", "random"))
        for m in self.metrics:
            _choice("metrics", m, METRICS)
        for p in self.agg_parts:
            _choice("agg_parts", p, AGG_PARTS)
        _range("alpha", self.alpha, 0.0, math.inf, "a number > 0", low_open=True)
        _positive_or_none("window", self.window)
        _positive_or_none("agg_static_after", self.agg_static_after)
        _positive_int("agg_chunk_size", self.agg_chunk_size)
        _range("reg_weight", self.reg_weight, 0.0, math.inf, "a number >= 0")
        _range("hinge_margin", self.hinge_margin, -1.0, 1.0, "a number in [-1, 1]")
        _positive_or_none("hinge_sample", self.hinge_sample)
        _positive_int("hinge_block", self.hinge_block)
        if self.spectrum_c1 is not None:
            _range("spectrum_c1", self.spectrum_c1, 0.0, math.inf, "a number > 0", low_open=True)
        _range("spectrum_c2", self.spectrum_c2, 0.0, math.inf, "a number >= 0")
        _range("spectrum_gamma", self.spectrum_gamma, 0.0, math.inf, "a number > 0", low_open=True)
        _positive_or_none("lowrank_rank", self.lowrank_rank)
        if self.head == "lowrank" and self.lowrank_rank is None:
            raise ConfigError("lowrank_rank=None: head='lowrank' needs an integer rank >= 1 (and < d)")
        _positive_or_none("metrics_every", self.metrics_every)
        _positive_or_none("bottleneck_every", self.bottleneck_every)
        _positive_int("hidden_samples", self.hidden_samples, minimum=2)
        fr = self.group_fractions
        if len(fr) != 3 or any(not (0 < f < 1) for f in fr) or abs(sum(fr) - 1) > 1e-6:
            raise ConfigError(
                f"group_fractions={fr!r}: expected three shares in (0, 1) summing to 1, "
                "e.g. (0.2, 0.5, 0.3) for rare / medium / frequent"
            )
        if any(i < 0 for i in self.special_ids + self.reg_exclude_ids):
            raise ConfigError("special_ids / reg_exclude_ids: token ids must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AnisoConfig:
        """Inverse of `to_dict`; unknown keys raise `ConfigError`."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown configuration fields {unknown}; known: {sorted(names)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def _choice(name: str, value: Any, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise ConfigError(f"{name}={value!r}: expected one of {', '.join(accepted)}")


def _range(name: str, value: Any, lo: float, hi: float, accepted: str, low_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > lo if low_open else value >= lo) and value <= hi
    if not ok:
        raise ConfigError(f"{name}={value!r}: expected {accepted}")


def _positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name}={value!r}: expected an integer >= {minimum}")


def _positive_or_none(name: str, value: Any) -> None:
    if value is not None:
        _positive_int(name, value)


__all__ = ["AnisoConfig", "ConfigError", "METHODS", "HEADS", "METRICS"]
