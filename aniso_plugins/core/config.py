"""One configuration object, shared by every trainer adapter.

`AnisoConfig` is a flat dataclass so that it maps one-to-one onto command-line flags
(torchtitan: ``--aniso.method agg --aniso.alpha 0.03``) and onto keyword arguments
(``AnisoConfig(method="agg", alpha=0.03)``). It is composed of the options every feature
declares beside its code (``methods/<name>/options.py``, ``metrics/<name>/options.py``, each an
`aniso_plugins.core.options.Options` dataclass with its own checks and state fields; the
registry lists them) plus the run's own fields below; a plugin ignores the fields of methods
that are off. Every value is checked at construction: a bad one raises `ConfigError` naming
the field, the value (its type, when that is what is wrong) and what is accepted, with the
closest accepted names of a misspelt one. Names from a fixed list (`Options.CHOICES`:
``method``, ``head``, ``metrics``, ...) are matched in any case; an unknown keyword raises
`TypeError` naming the closest fields (every registered plugin's included). `extend` adds a
third-party plugin's options.

The dataclass is frozen (``cfg.alpha = 0.1`` raises `dataclasses.FrozenInstanceError`; use
``cfg.replace(alpha=0.1)``, which validates again), hashable and comparable. Sequence fields are
annotated as ``list[...]`` so that argument parsers that build flags from annotations
(transformers' `HfArgumentParser`: ``--metrics geometry frequency``; tyro:
``--aniso.metrics geometry frequency``; jsonargparse / LightningCLI: YAML lists) accept them;
they are stored as tuples. See docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any

from aniso_plugins.core import registry
from aniso_plugins.core.errors import AnisoError, ConfigError
from aniso_plugins.core.options import (
    MethodList,
    Options,
    StrList,
    as_sequence,
    canonical_choice,
    check_choice,
    check_choices,
    check_positive_or_none,
    closest,
    list_field,
)

METHODS: tuple[str, ...] = tuple(registry.METHODS)
HEADS: tuple[str, ...] = tuple(registry.HEADS)
METRICS: tuple[str, ...] = tuple(registry.METRICS)
STATE_MISMATCH = ("error", "reset")


@dataclass(frozen=True)
class CoreOptions(Options):
    """What the run trains: its methods, its head and the ignored target value."""

    SEQUENCES = {"method": str}
    CHOICES = {"method": METHODS, "head": HEADS}
    STATE_FIELDS = ("method", "head", "ignore_index")

    method: MethodList = list_field("none")
    """Training methods, any of METHODS ("none" alone means plain MLE). Combinations that
    cannot work raise `ConfigError`: two head regularizers (they share ``reg_weight``), and
    "simcse" (sentence encoders) with the causal-LM methods "agg" or "simctg"."""
    head: str = "keep"
    ignore_index: int = -100

    def validate(self) -> None:
        check_choices("method", self.method, METHODS)
        if not self.method:
            raise ConfigError('method=(): name at least one method ("none" for plain MLE)')
        if "none" in self.method and len(self.method) > 1:
            raise ConfigError(
                f"method={self.method!r}: 'none' (plain MLE) cannot be combined with other methods; drop it"
            )
        check_choice("head", self.head, HEADS)


_FEATURE_OPTIONS: tuple[type[Options], ...] = registry.option_classes()


def _checked_keywords(cls: type) -> type:
    """`cls` whose ``__init__`` (the dataclass's) refuses an unknown keyword with a `TypeError`
    (as Python does) that names the closest fields (`_unknown`); the signature is kept."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - _field_names(type(self)))
        if unknown:
            what = "an unexpected keyword argument" if len(unknown) == 1 else "unexpected keyword arguments"
            raise TypeError(f"{type(self).__name__}() got {what} {_unknown(type(self), unknown)}")
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


@_checked_keywords
@dataclass(frozen=True)
class AnisoConfig(*reversed(_FEATURE_OPTIONS), CoreOptions):  # fields: the core's, then each feature's, in order
    """What to run. Defaults measure geometry and change nothing about training.

    Training methods (one or several, each with its own weight field):
        method: "none" (MLE), "agg" (Yu et al. 2022), "cosreg" (Gao et al. 2019),
            "hinge" (pairwise cosine hinge), "spectrum" (Wang et al. 2020), "simctg" (Su et
            al. 2022), "uniformity" (Wang & Isola 2020), "simcse" (Gao, Yao & Chen 2021).
            ``method="agg"`` and ``method=("agg", "simctg")`` both work; `uses` asks for one.
        head: "keep", "untie" (independent output matrix) or "lowrank" (W = A·B).
        ignore_index: target value that marks positions without a loss.

    The fields of each feature are declared in its options class (`AGGOptions`,
    `RegularizerOptions`, ...; see `aniso_plugins.core.registry.OPTIONS`); each checks its own.
    Frozen: change a copy with `replace`. Sequence fields (method, special_ids,
    reg_exclude_ids, agg_parts, metrics, group_fractions, uniformity_on,
    update_efficiency_eps) accept any sequence (or a "a,b c" string) and are stored as tuples.
    """

    SEQUENCES = {"metrics": str}
    CHOICES = {"metrics": METRICS, "on_state_mismatch": STATE_MISMATCH}

    metrics: StrList = list_field("geometry")
    """Metric plugins to run, any of METRICS."""
    metrics_every: int | None = None
    """Optimizer steps between metric measurements; None: at the trainer's logging steps."""

    load_entry_points: bool = True
    """Load third-party plugins from the ``aniso_plugins`` entry-point group."""
    on_state_mismatch: str = "error"
    """What a resume does with saved plugin state that cannot be used (unreadable file, another
    configuration, a token-counter window that cannot be re-cut exactly): "error" raises a
    `StateError` naming the file and the difference; "reset" warns and starts the plugins'
    state (AGG's counters, target counts) fresh."""

    def __post_init__(self) -> None:
        sequences, choices = self.sequence_fields(), self.choice_fields()
        for name, kind in sequences.items():  # frozen: normalize through object.__setattr__
            object.__setattr__(self, name, as_sequence(name, getattr(self, name), kind))
        for name, names in choices.items():  # as spelt in the list, before any check reads them
            value = getattr(self, name)
            spelt = (
                tuple(canonical_choice(name, v, names, choices) for v in value)
                if name in sequences
                else canonical_choice(name, value, names, choices)
            )
            object.__setattr__(self, name, spelt)
        for options in self.option_classes():
            if "validate" in vars(options):  # each class's own checks, once
                options.validate(self)

    def validate(self) -> None:
        check_choices("metrics", self.metrics, METRICS)
        check_choice("on_state_mismatch", self.on_state_mismatch, STATE_MISMATCH)
        check_positive_or_none("metrics_every", self.metrics_every)

    @classmethod
    def option_classes(cls) -> list[type[Options]]:
        """The options classes this configuration is made of, core first, own fields last."""
        return [c for c in reversed(cls.__mro__) if isinstance(c, type) and issubclass(c, Options) and c is not Options]

    @classmethod
    def sequence_fields(cls) -> dict[str, type]:
        """Every sequence field and its element type (stored as tuples)."""
        return {name: kind for c in cls.option_classes() for name, kind in vars(c).get("SEQUENCES", {}).items()}

    @classmethod
    def choice_fields(cls) -> dict[str, tuple[str, ...]]:
        """Every field whose values are names from a fixed list, and the names (each feature's
        `CHOICES`; matched in any case)."""
        return {name: tuple(names) for c in cls.option_classes() for name, names in vars(c).get("CHOICES", {}).items()}

    @classmethod
    def state_fields(cls) -> tuple[str, ...]:
        """The fields whose change makes saved plugin state unusable (each feature's `STATE_FIELDS`)."""
        return tuple(name for c in cls.option_classes() for name in vars(c).get("STATE_FIELDS", ()))

    @classmethod
    def adapter_defaults(cls, adapter: str) -> dict[str, Any]:
        """The fields whose default differs under the trainer adapter `adapter` ("torchtitan",
        ...), from each feature's `ADAPTER_DEFAULTS`."""
        out: dict[str, Any] = {}
        for c in cls.option_classes():
            out.update(vars(c).get("ADAPTER_DEFAULTS", {}).get(adapter, {}))
        return out

    @classmethod
    def extend(cls, *options: type[Options]) -> type[AnisoConfig]:
        """This configuration with a third-party plugin's options (frozen `Options` dataclasses)
        as more fields of the same flat surface: ``Config = AnisoConfig.extend(MyOptions)``;
        ``Config(method="agg", my_weight=0.5)``. Field names must be new."""
        taken = {f.name for f in dataclasses.fields(cls)}
        for extra in options:
            if not (dataclasses.is_dataclass(extra) and issubclass(extra, Options)):
                raise TypeError(f"AnisoConfig.extend: {extra!r} is not an Options dataclass")
            clash = sorted(taken & {f.name for f in dataclasses.fields(extra)})
            if clash:
                raise ConfigError(f"AnisoConfig.extend: {extra.__name__} redefines the fields {clash}")
            taken |= {f.name for f in dataclasses.fields(extra)}
        name = "AnisoConfig+" + "+".join(o.__name__ for o in options)
        return _checked_keywords(dataclass(frozen=True)(type(name, (*reversed(options), cls), {"__module__": cls.__module__})))

    def uses(self, method: str) -> bool:
        """Whether `method` (a name of METHODS) is among the configured training methods."""
        return method in self.method

    def replace(self, **changes: Any) -> AnisoConfig:
        """A copy with `changes` applied, validated like a new configuration; unknown field
        names raise `ConfigError` naming the closest fields."""
        _known(type(self), changes)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AnisoConfig:
        """Inverse of `to_dict`; unknown keys raise `ConfigError` naming the closest fields."""
        _known(cls, data)
        return cls(**data)


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def _unknown(cls: type[AnisoConfig], unknown: list[str]) -> str:
    """Each unknown field name with what was likely meant: a value of a `CHOICES` field given as
    a keyword (``agg=True``: ``method='agg'``), else the closest field names; else where the
    fields are listed."""
    fields, choices = _field_names(cls), cls.choice_fields()
    said = []
    for name in unknown:
        owners = [f"{f}={spelt!r}" for f, names in choices.items() for spelt in names if spelt.casefold() == name.casefold()]
        close = closest(name, fields)
        if owners:
            said.append(f"{name!r} (a value, not a field: {' or '.join(owners)})")
        elif close:
            said.append(f"{name!r} (did you mean {' or '.join(map(repr, close))}?)")
        else:
            said.append(
                f"{name!r} (no field of {cls.__name__}: docs/configuration.md lists them; a third-party plugin's "
                "fields exist once it is installed, or with AnisoConfig.extend)"
            )
    return ", ".join(said)


def _known(cls: type, data: Any) -> None:
    unknown = sorted(set(data) - _field_names(cls))
    if unknown:
        raise ConfigError(f"unknown configuration fields {unknown}: {_unknown(cls, unknown)}; known: {sorted(_field_names(cls))}")


__all__ = ["AnisoConfig", "AnisoError", "ConfigError", "CoreOptions", "METHODS", "HEADS", "METRICS"]
