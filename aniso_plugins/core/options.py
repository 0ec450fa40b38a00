"""What a feature's options are made of: the `Options` base every feature's frozen options
dataclass derives from (its fields, the checks of their values, the fields its saved state
depends on), the list annotations every argument parser reads, and the checks that name the
field, the value (its type too, when that is what is wrong) and what is accepted, with the
closest accepted spelling of a misspelt name. `aniso_plugins.AnisoConfig` is the flat union of
the registered options (`aniso_plugins.core.registry.OPTIONS`)."""

from __future__ import annotations

import difflib
import math
import operator
from collections.abc import Callable, Iterable, Mapping
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
    CHOICES: the fields whose value (a sequence field: each element) is a name from a fixed
    list, field -> the names: matched in any case and stored as spelt there (``"AGG"`` is
    ``"agg"``), a misspelt name answered with the closest ones, a name of another CHOICES
    field pointed there (`canonical_choice`);
    STATE_FIELDS: the fields whose change makes the feature's saved state unusable (a resume
    under another value is refused, `aniso_plugins.core.state.check_compatible`);
    ADAPTER_DEFAULTS: trainer adapter name -> the feature's fields whose default differs under
    that adapter (`AnisoConfig.adapter_defaults`);
    `validate`: checks the values, raising `ConfigError`. In `AnisoConfig` it runs with the
    whole configuration as ``self``, so a check may read another feature's field."""

    SEQUENCES: ClassVar[Mapping[str, type]] = {}
    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = {}
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
        raise ConfigError(f"{shown(name, value, True)}: expected a list of {kind.__name__} values") from None
    out: list[Any] = []
    for item in items:
        for v in item.replace(",", " ").split() if isinstance(item, str) else [item]:
            try:
                out.append(_element(v, kind))
            except (TypeError, ValueError):
                raise ConfigError(f"{name}={value!r}: {v!r} ({type(v).__name__}) is not a {kind.__name__}") from None
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


def shown(name: str, value: Any, wrong_type: bool = False) -> str:
    """``name=value`` for a message, with the value's type when that is what is wrong
    (``alpha='0.1' (str)``)."""
    return f"{name}={value!r} ({type(value).__name__})" if wrong_type else f"{name}={value!r}"


def closest(word: str, names: Iterable[str], n: int = 3) -> list[str]:
    """The names closest to `word` (case ignored; `difflib`), best first."""
    by_key = {name.casefold(): name for name in names}
    return [by_key[k] for k in difflib.get_close_matches(word.casefold(), by_key, n=n, cutoff=0.6)]


def _or(names: Iterable[str]) -> str:
    return " or ".join(repr(n) for n in names)


def _match(value: str, accepted: Iterable[str]) -> str | None:
    """`value` as spelt in `accepted` when it is one of them in any case, else None."""
    return next((a for a in accepted if a.casefold() == value.casefold()), None)


def choice_error(
    name: str, value: Any, accepted: tuple[str, ...], elsewhere: Mapping[str, tuple[str, ...]] | None = None
) -> ConfigError:
    """The error for `value`, not one of `accepted`: the value, its type when not a str, what
    is accepted, and the other fields of `elsewhere` (field -> names) that take it, or else the
    closest accepted names."""
    message = f"{shown(name, value, not isinstance(value, str))}: expected one of {', '.join(accepted)}"
    if not isinstance(value, str):
        return ConfigError(message)
    owners = [(f, spelt) for f, names in (elsewhere or {}).items() if f != name and (spelt := _match(value, names))]
    if owners:
        where = " or ".join(f"{f}={spelt!r}" for f, spelt in owners)
        return ConfigError(f"{message}; {value!r} is not a value of {name} but of {' or '.join(f for f, _ in owners)}: {where}")
    close = closest(value, accepted)
    return ConfigError(f"{message}; did you mean {_or(close)}?" if close else message)


def canonical_choice(
    name: str, value: Any, accepted: tuple[str, ...], elsewhere: Mapping[str, tuple[str, ...]] | None = None
) -> str:
    """`value` as spelt in `accepted`, matched in any case (``"AGG"`` -> ``"agg"``); otherwise
    `choice_error` raised (`elsewhere`: the other fields' names, field -> names)."""
    spelt = _match(value, accepted) if isinstance(value, str) else None
    if spelt is None:
        raise choice_error(name, value, accepted, elsewhere)
    return spelt


def check_choice(name: str, value: Any, accepted: tuple[str, ...]) -> None:
    """`value` one of `accepted` exactly (a field in `Options.CHOICES` is matched in any case
    before its checks run); otherwise `choice_error`."""
    if value not in accepted:
        raise choice_error(name, value, accepted)


def check_choices(name: str, values: tuple, accepted: tuple[str, ...]) -> None:
    """Every value one of `accepted`, none twice."""
    for v in values:
        check_choice(name, v, accepted)
    check_unique(name, values)


def _number_hint(name: str, value: Any, kinds: tuple[type, ...], check: Callable[[Any], None]) -> str:
    """``"; did you mean alpha=0.1?"`` for a number written as a string (a YAML ``1e-3`` is one)
    that `check` accepts as a number, else ""."""
    for kind in kinds if isinstance(value, str) else ():
        try:
            number = kind(value)
            check(number)
        except ValueError:  # not this kind, or refused as a number too (ConfigError)
            continue
        return f"; did you mean {name}={number!r}?"
    return ""


def check_range(name: str, value: Any, lo: float, hi: float, accepted: str, low_open: bool = False) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = number and math.isfinite(value) and (value > lo if low_open else value >= lo) and value <= hi
    if not ok:
        hint = _number_hint(name, value, (int, float), lambda x: check_range(name, x, lo, hi, accepted, low_open))
        raise ConfigError(f"{shown(name, value, not number)}: expected {accepted}{hint}")


def check_positive_int(name: str, value: Any, minimum: int = 1) -> None:
    integer = isinstance(value, int) and not isinstance(value, bool)
    if not integer or value < minimum:
        hint = _number_hint(name, value, (int,), lambda x: check_positive_int(name, x, minimum))
        raise ConfigError(f"{shown(name, value, not integer)}: expected an integer >= {minimum}{hint}")


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
    "canonical_choice",
    "check_choice",
    "check_choices",
    "check_positive_int",
    "check_positive_or_none",
    "check_range",
    "check_token_ids",
    "check_unique",
    "choice_error",
    "closest",
    "list_field",
    "shown",
]
