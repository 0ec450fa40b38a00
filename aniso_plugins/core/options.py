"""What a feature's options are made of: the `Options` base every feature's frozen options
dataclass derives from (its fields, the checks of their values, the fields its saved state
depends on), the list annotations every argument parser reads, and the checks that name the
field, the value and what is accepted. `aniso_plugins.AnisoConfig` is the flat union of the
registered options (`aniso_plugins.core.registry.OPTIONS`)."""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Union

from aniso_plugins.core.errors import ConfigError

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


def list_field(*values: Any) -> Any:
    """A sequence field's default (a factory, as parsers want for list-annotated fields)."""
    return field(default_factory=lambda: list(values))


@dataclass(frozen=True)
class Options:
    """Base of a feature's options: a frozen dataclass whose fields become `AnisoConfig` fields.

    SEQUENCES: the sequence fields and their element types (stored as tuples, `as_sequence`);
    STATE_FIELDS: the fields whose change makes the feature's saved state unusable (a resume
    under another value is refused, `aniso_plugins.core.state.check_compatible`);
    ADAPTER_DEFAULTS: trainer adapter name -> the feature's fields whose default differs under
    that adapter (`AnisoConfig.adapter_defaults`);
    `validate`: checks the values, raising `ConfigError`. In `AnisoConfig` it runs with the
    whole configuration as ``self``, so a check may read another feature's field."""

    SEQUENCES: ClassVar[Mapping[str, type]] = {}
    STATE_FIELDS: ClassVar[tuple[str, ...]] = ()
    ADAPTER_DEFAULTS: ClassVar[Mapping[str, Mapping[str, Any]]] = {}

    def validate(self) -> None:
        """Raise `ConfigError` for a value this feature cannot honour."""


def as_sequence(name: str, value: Any, kind: type) -> tuple:
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


def check_unique(name: str, values: tuple) -> None:
    seen = set()
    for v in values:
        if v in seen:
            raise ConfigError(f"{v!r} is listed twice in {name} ({name}={values!r}); list each once")
        seen.add(v)


def check_choice(name: str, value: Any, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise ConfigError(f"{name}={value!r}: expected one of {', '.join(accepted)}")


def check_choices(name: str, values: tuple, accepted: tuple[str, ...]) -> None:
    """Every value one of `accepted`, none twice."""
    for v in values:
        check_choice(name, v, accepted)
    check_unique(name, values)


def check_range(name: str, value: Any, lo: float, hi: float, accepted: str, low_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > lo if low_open else value >= lo) and value <= hi
    if not ok:
        raise ConfigError(f"{name}={value!r}: expected {accepted}")


def check_positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name}={value!r}: expected an integer >= {minimum}")


def check_positive_or_none(name: str, value: Any) -> None:
    if value is not None:
        check_positive_int(name, value)


def check_token_ids(name: str, ids: tuple[int, ...]) -> None:
    if any(i < 0 for i in ids):
        raise ConfigError(f"{name}={ids!r}: token ids must be >= 0")


__all__ = [
    "FloatList",
    "IntList",
    "MethodList",
    "Options",
    "StrList",
    "as_sequence",
    "check_choice",
    "check_choices",
    "check_positive_int",
    "check_positive_or_none",
    "check_range",
    "check_token_ids",
    "check_unique",
    "list_field",
]
