"""One configuration object, shared by every trainer adapter.

`AnisoConfig` is a flat dataclass so that it maps one-to-one onto command-line flags
(torchtitan: ``--aniso.method agg --aniso.alpha 0.03``) and onto keyword arguments
(``AnisoConfig(method="agg", alpha=0.03)``). Fields are grouped by the plugin that reads
them; a plugin ignores the fields of methods that are off. Every value is checked at
construction: a bad one raises `ConfigError` naming the field, the value and what is accepted.

The dataclass is frozen (``cfg.alpha = 0.1`` raises `dataclasses.FrozenInstanceError`; use
``cfg.replace(alpha=0.1)``, which validates again), hashable and comparable. Sequence fields are
annotated as ``list[...]`` so that argument parsers that build flags from annotations
(transformers' `HfArgumentParser`: ``--metrics geometry frequency``; tyro:
``--aniso.metrics geometry frequency``; jsonargparse / LightningCLI: YAML lists) accept them;
they are stored as tuples. See docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
from dataclasses import dataclass, field
from typing import Annotated, Any, Union

from aniso_plugins.core import registry
from aniso_plugins.core.errors import AnisoError, ConfigError

METHODS: tuple[str, ...] = tuple(registry.METHODS)
HEADS: tuple[str, ...] = tuple(registry.HEADS)
METRICS: tuple[str, ...] = tuple(registry.METRICS)
AGG_PARTS = ("a", "b", "c")
SPECTRUM_PRIORS = ("poly", "exp", "ratio")
STATE_MISMATCH = ("error", "reset")
SIMCSE_POOLING = ("cls", "mean")
UNIFORMITY_ON = ("head", "hidden")
HEAD_REGULARIZERS = ("cosreg", "hinge", "spectrum")
"""Methods that share ``reg_weight`` (one of them per configuration)."""
ENCODER_METHODS = ("simcse",)
CAUSAL_LM_METHODS = ("agg", "simctg")


# Sequence fields are annotated ``list[X]``: transformers' HfArgumentParser turns only list
# fields into multi-value flags (``--metrics geometry frequency``), jsonargparse reads YAML
# lists. The values are stored as tuples (hashable, immutable); tyro, torchtitan's CLI, is told
# so (Annotated metadata that the other parsers drop), so its defaults match their type.
try:
    import tyro as _tyro
except ImportError:  # no torchtitan extra: plain lists
    IntList, StrList, FloatList = list[int], list[str], list[float]
    MethodList = Union[list[str], str]
else:
    IntList = Annotated[list[int], _tyro.conf.arg(constructor=tuple[int, ...])]
    StrList = Annotated[list[str], _tyro.conf.arg(constructor=tuple[str, ...])]
    FloatList = Annotated[list[float], _tyro.conf.arg(constructor=tuple[float, ...])]
    MethodList = Annotated[Union[list[str], str], _tyro.conf.arg(constructor=tuple[str, ...])]
# ``method`` also takes one name where a parser reads types (a YAML ``method: agg`` of a
# LightningCLI config stays valid); HfArgumentParser drops the ``str`` and reads a list.


def _default(*values: Any) -> Any:
    """A sequence field's default (a factory, as parsers want for list-annotated fields)."""
    return field(default_factory=lambda: list(values))


# Sequence fields and their element types (stored as tuples; see _sequence).
_SEQUENCES: dict[str, type] = {
    "method": str,
    "special_ids": int,
    "reg_exclude_ids": int,
    "agg_parts": str,
    "metrics": str,
    "group_fractions": float,
    "uniformity_on": str,
    "update_efficiency_eps": float,
}


@dataclass(frozen=True)
class AnisoConfig:
    """What to run. Defaults measure geometry and change nothing about training.

    Training methods (one or several, each with its own weight field):
        method: "none" (MLE), "agg" (Yu et al. 2022), "cosreg" (Gao et al. 2019),
            "hinge" (pairwise cosine hinge), "spectrum" (Wang et al. 2020), "simctg" (Su et
            al. 2022), "uniformity" (Wang & Isola 2020), "simcse" (Gao, Yao & Chen 2021).
            ``method="agg"`` and ``method=("agg", "simctg")`` both work; `uses` asks for one.
        head: "keep", "untie" (independent output matrix) or "lowrank" (W = A·B).
        ignore_index: target value that marks positions without a loss.

    Frozen: change a copy with `replace`. Sequence fields (method, special_ids,
    reg_exclude_ids, agg_parts, metrics, group_fractions, uniformity_on,
    update_efficiency_eps) accept any sequence (or a "a,b c" string) and are stored as tuples.
    """

    method: MethodList = _default("none")
    """Training methods, any of METHODS ("none" alone means plain MLE). Combinations that
    cannot work raise `ConfigError`: two head regularizers (they share ``reg_weight``), and
    "simcse" (sentence encoders) with the causal-LM methods "agg" or "simctg"."""
    head: str = "keep"
    ignore_index: int = -100

    # --- AGG (docs/methods.md §1) -------------------------------------------------------------
    alpha: float = 0.03
    """Rare threshold: token k is rare iff a_k < alpha (strict). Paper: 0.03 LM, 0.08 MT."""
    window: int | None = None
    """K, optimizer steps the token counter remembers. None: one epoch when the adapter knows it."""
    special_ids: IntList = _default()
    """Ids with a_k = 1 (never rare), like fairseq's 4 specials."""
    agg_g1: bool = True
    """Ablation: False sets g1 = 1 (no gating for non-rare targets)."""
    agg_g2: bool = True
    """Ablation: False sets g2 = 1 (no gating for rare targets)."""
    agg_static_after: int | None = None
    """Ablation: freeze the rare group (and gates) after this many optimizer steps."""
    agg_freeze_rare: bool = False
    """Ablation: the paper's Freeze experiment, rare rows get no output-side gradient at all."""
    agg_parts: StrList = _default("b", "c")
    """Gradient parts of a rare row to gate (docs/methods.md §0): (a) own contexts, (b) non-rare
    targets, (c) other rare targets. Default ("b", "c") is the official AGG."""
    agg_fused: bool = False
    """Run AGG as the fused chunked AGG cross-entropy (no full logits) instead of the gated head:
    only adapters that own the loss can (torchtitan, where it is the default); the HF and
    Lightning adapters refuse it."""
    agg_chunk_size: int | None = None
    """Token rows per chunk of the fused AGG cross-entropy; None: 1024, or fewer where a chunk's
    float32 logits would exceed 256 MiB (`aniso_plugins.methods.agg.fused_ce.default_chunk_rows`)."""

    # --- Regularizers (docs/methods.md §3-4) ---------------------------------------------------
    reg_weight: float = 1.0
    """γ of CosReg, λ of the hinge, λ of spectrum control."""
    reg_every_microbatch: bool = False
    """Apply a regularizer on every micro-batch (weight / accumulation steps) instead of once
    per optimizer step. The two conventions give the same gradient; this one spreads the cost."""
    reg_exclude_ids: IntList = _default()
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

    # --- Contrastive methods (docs/methods.md §12-14) -----------------------------------------
    simctg_weight: float = 1.0
    """Weight of the SimCTG token contrastive loss (Su et al. 2022: 1, added to the MLE loss)."""
    simctg_margin: float = 0.5
    """ρ of SimCTG: pairs of positions with s(h_i,h_i) − s(h_i,h_j) < ρ are penalized (paper: 0.5)."""
    simctg_block: int = 512
    """Query positions per block of the SimCTG loss (memory O(B·T·block))."""
    uniformity_weight: float = 1.0
    """Weight of the uniformity regularizer (Wang & Isola 2020)."""
    uniformity_t: float = 2.0
    """t of L_uniform = log E exp(−t‖x̂_i − x̂_j‖²) (paper: 2)."""
    uniformity_on: StrList = _default("head")
    """What the uniformity regularizer spreads: "head" (the LM head rows), "hidden" (the head's
    input of each micro-batch), or both."""
    uniformity_sample: int | None = None
    """Head rows sampled per step for the uniformity regularizer (unbiased pair mean); None:
    exact, blockwise over all rows."""
    uniformity_block: int = 1024
    """Rows per block of the exact uniformity regularizer and metric (memory O(block·V))."""
    simcse_weight: float = 1.0
    """Weight of the SimCSE InfoNCE loss (the whole loss when the batch has no labels)."""
    simcse_temperature: float = 0.05
    """τ of SimCSE's InfoNCE (paper: 0.05)."""
    simcse_pooling: str = "cls"
    """Sentence representation: "cls" (first position) or "mean" (mean over non-padding positions)."""

    # --- Heads (seed 001) -------------------------------------------------------------------
    lowrank_rank: int | None = None
    """Rank r < d of the low-rank head W = A·B."""
    lowrank_init: str = "svd"
    """"svd" (truncated SVD of the current head) or "random"."""

    # --- Metrics (docs/methods.md §2, §7-9) ----------------------------------------------------
    metrics: StrList = _default("geometry")
    """Metric plugins to run, any of METRICS."""
    metrics_every: int | None = None
    """Optimizer steps between metric measurements; None: at the trainer's logging steps."""
    group_fractions: FloatList = _default(0.2, 0.5, 0.3)
    """Rare / medium / frequent shares of the vocabulary for frequency groups (AGG seed)."""
    hidden_samples: int = 256
    """Token representations sampled per layer and measurement for hidden-state anisotropy."""
    bottleneck_every: int | None = None
    """Optimizer steps between gradient-bottleneck probes; None: metrics_every."""
    update_efficiency: bool = False
    """With the "bottleneck" metric: also measure the update efficiency through the head on
    each probed micro-batch (docs/methods.md §9.5). Costs 2kVd flops in the backward, 3kV
    float32 values kept until the measurement, and (1 + 2·len(update_efficiency_eps)) float64
    log-sum-exps over k×V at the measurement, k = update_efficiency_positions."""
    update_efficiency_eps: FloatList = _default(0.001, 0.01, 0.1)
    """Logit-update budgets ε, as fractions of ‖Z‖_F, of the update-efficiency probe."""
    update_efficiency_positions: int = 256
    """Positions per rank the update-efficiency probe keeps (k rows of logits and gradients)."""
    uniformity_rows: int = 4096
    """Head rows sampled (identically on every rank) for the "uniformity" metric."""
    ethayarajh_words: int = 256
    """Most frequent repeated tokens of the measured micro-batch kept for SelfSim ("ethayarajh")."""
    report_at_end: bool = False
    """At the end of training, write the offline report of the trained model's embedding and
    head (`aniso_plugins.offline.report`: report.json, report.md and the plots; docs/report.md) into
    ``<output dir>/aniso_report`` (HF: ``args.output_dir``, Lightning: the trainer's
    ``default_root_dir``), on the main process. Plots need ``aniso-plugins[report]``."""

    # --- Plugins and state ------------------------------------------------------------------
    load_entry_points: bool = True
    """Load third-party plugins from the ``aniso_plugins`` entry-point group."""
    on_state_mismatch: str = "error"
    """What a resume does with saved plugin state that cannot be used (unreadable file, another
    configuration, a token-counter window that cannot be re-cut exactly): "error" raises a
    `StateError` naming the file and the difference; "reset" warns and starts the plugins'
    state (AGG's counters, target counts) fresh."""

    def __post_init__(self) -> None:
        for name, kind in _SEQUENCES.items():  # frozen: normalize through object.__setattr__
            object.__setattr__(self, name, _sequence(name, getattr(self, name), kind))
        for m in self.method:
            _choice("method", m, METHODS)
        _unique("method", self.method)
        _method_combination(self.method)
        for u in self.uniformity_on:
            _choice("uniformity_on", u, UNIFORMITY_ON)
        _unique("uniformity_on", self.uniformity_on)
        _choice("simcse_pooling", self.simcse_pooling, SIMCSE_POOLING)
        _choice("head", self.head, HEADS)
        _choice("spectrum_prior", self.spectrum_prior, SPECTRUM_PRIORS)
        _choice("lowrank_init", self.lowrank_init, ("svd", "random"))
        _choice("on_state_mismatch", self.on_state_mismatch, STATE_MISMATCH)
        for m in self.metrics:
            _choice("metrics", m, METRICS)
        for p in self.agg_parts:
            _choice("agg_parts", p, AGG_PARTS)
        _unique("metrics", self.metrics)
        _unique("agg_parts", self.agg_parts)
        _range("alpha", self.alpha, 0.0, math.inf, "a number > 0", low_open=True)
        _positive_or_none("window", self.window)
        _positive_or_none("agg_static_after", self.agg_static_after)
        _positive_or_none("agg_chunk_size", self.agg_chunk_size)
        _range("reg_weight", self.reg_weight, 0.0, math.inf, "a number >= 0")
        _range("hinge_margin", self.hinge_margin, -1.0, 1.0, "a number in [-1, 1]")
        _positive_or_none("hinge_sample", self.hinge_sample)
        _positive_int("hinge_block", self.hinge_block)
        if self.spectrum_c1 is not None:
            _range("spectrum_c1", self.spectrum_c1, 0.0, math.inf, "a number > 0", low_open=True)
        _range("spectrum_c2", self.spectrum_c2, 0.0, math.inf, "a number >= 0")
        _range("spectrum_gamma", self.spectrum_gamma, 0.0, math.inf, "a number > 0", low_open=True)
        for name in ("simctg_weight", "uniformity_weight", "simcse_weight"):
            _range(name, getattr(self, name), 0.0, math.inf, "a number >= 0")
        _range("simctg_margin", self.simctg_margin, 0.0, 2.0, "a number in [0, 2] (cosines differ by at most 2)")
        _range("uniformity_t", self.uniformity_t, 0.0, math.inf, "a number > 0", low_open=True)
        _range("simcse_temperature", self.simcse_temperature, 0.0, math.inf, "a number > 0", low_open=True)
        _positive_int("simctg_block", self.simctg_block)
        _positive_int("uniformity_block", self.uniformity_block)
        _positive_or_none("uniformity_sample", self.uniformity_sample)
        if self.uniformity_sample is not None:
            _positive_int("uniformity_sample", self.uniformity_sample, minimum=2)
        if not self.uniformity_on:
            raise ConfigError('uniformity_on=(): expected "head", "hidden" or both')
        _positive_int("uniformity_rows", self.uniformity_rows, minimum=2)
        _positive_int("ethayarajh_words", self.ethayarajh_words)
        _positive_int("update_efficiency_positions", self.update_efficiency_positions)
        if self.update_efficiency and "bottleneck" not in self.metrics:
            raise ConfigError(
                f"update_efficiency=True: the probe runs on the gradient-bottleneck probe's micro-batch; add "
                f"'bottleneck' to metrics (metrics={self.metrics!r})"
            )
        if not self.update_efficiency_eps or any(not (0 < e <= 1) for e in self.update_efficiency_eps):
            raise ConfigError(
                f"update_efficiency_eps={self.update_efficiency_eps!r}: expected one or more fractions of ‖Z‖ in (0, 1]"
            )
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

    def uses(self, method: str) -> bool:
        """Whether `method` (a name of METHODS) is among the configured training methods."""
        return method in self.method

    def replace(self, **changes: Any) -> AnisoConfig:
        """A copy with `changes` applied, validated like a new configuration; unknown field
        names raise `ConfigError`."""
        _known(changes)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AnisoConfig:
        """Inverse of `to_dict`; unknown keys raise `ConfigError`."""
        _known(data)
        return cls(**data)


def _known(data: Any) -> None:
    names = {f.name for f in dataclasses.fields(AnisoConfig) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown configuration fields {unknown}; known: {sorted(names)}")


def _sequence(name: str, value: Any, kind: type) -> tuple:
    """`value` as a tuple of `kind`; strings are split at commas and whitespace ("0, 1 2"), so
    one flag value or environment variable can carry a whole list ("" is the empty list)."""
    try:
        items = [value] if isinstance(value, str) else list(value)
    except TypeError:
        raise ConfigError(f"{name}={value!r}: expected a list of {kind.__name__} values") from None
    out: list[Any] = []
    for item in items:
        for v in item.replace(",", " ").split() if isinstance(item, str) else [item]:
            try:
                out.append(_element(v, kind))
            except (TypeError, ValueError):
                raise ConfigError(f"{name}={value!r}: {v!r} is not a {kind.__name__}") from None
    return tuple(out)


def _element(v: Any, kind: type) -> Any:
    if isinstance(v, bool):  # True is an int to Python, never a token id or a share
        raise TypeError
    if kind is str:
        if not isinstance(v, str):
            raise TypeError
        return v
    if isinstance(v, str):
        return kind(v)
    return operator.index(v) if kind is int else float(v)  # index: ints, numpy / torch integers


def _method_combination(methods: tuple[str, ...]) -> None:
    """Refuse method lists that cannot work together (see the ``method`` field)."""
    if not methods:
        raise ConfigError('method=(): name at least one method ("none" for plain MLE)')
    if "none" in methods and len(methods) > 1:
        raise ConfigError(f"method={methods!r}: 'none' (plain MLE) cannot be combined with other methods; drop it")
    regs = [m for m in methods if m in HEAD_REGULARIZERS]
    if len(regs) > 1:
        raise ConfigError(
            f"method={methods!r}: {' and '.join(regs)} both regularize the head rows with the one weight "
            "reg_weight; choose one of them"
        )
    encoder = [m for m in methods if m in ENCODER_METHODS]
    causal = [m for m in methods if m in CAUSAL_LM_METHODS]
    if encoder and causal:
        raise ConfigError(
            f"method={methods!r}: {encoder[0]} trains sentence encoders (masked LMs, in-batch sentence pairs) "
            f"and {causal[0]} is for causal-LM training; run them separately"
        )


def _unique(name: str, values: tuple) -> None:
    seen = set()
    for v in values:
        if v in seen:
            raise ConfigError(f"{v!r} is listed twice in {name} ({name}={values!r}); list each once")
        seen.add(v)


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


__all__ = ["AnisoConfig", "AnisoError", "ConfigError", "METHODS", "HEADS", "METRICS"]
