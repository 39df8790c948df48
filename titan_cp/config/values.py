"""The bounds a field declares beside itself, and the one walker of type hints.

A field states its type and its bounds once, in its annotation::

    steps: Annotated[int, Positive] = 10000
    seed: Annotated[int, AtLeast(0)] = 0
    global_batch_size: Annotated[int, PositiveOrAuto] = -1
    decay_ratio: Annotated[float | None, InRange(0, 1)] = None
    packing: Literal["stream", "best_fit"] = "stream"

:func:`convert` walks such a hint for one value: a TOML value or a value set in code
(``from_text=False``: checked), or a command-line string (``from_text=True``: parsed, then
checked). It checks the type (``Literal`` choices included; floats finite, integers 64-bit),
then every bound, and raises ``ValueError`` naming the key (``<section>.<field>``), which the
caller derives from where the field sits: no check spells its key a second time.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from titan_cp.errors import did_you_mean

INT64 = (-(2**63), 2**63 - 1)  # every integer key must fit (seeds, sizes and steps become tensors and C ints)
BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}
NONE_WORDS = ("none", "null", "")  # an optional value unset on the command line


# --------------------------------------------------------------------------------------------
# bounds: each checks a value already of its field's type


class Bound:
    """A constraint on a field's value; ``optional``: the field may also be unset (``None``)."""

    def check(self, key: str, value: Any, optional: bool) -> None:
        raise NotImplementedError


class _Positive(Bound):
    def check(self, key: str, value: Any, optional: bool) -> None:
        if value <= 0:
            raise ValueError(f"{key} must be positive, got {value}")


class _PositiveOrAuto(Bound):
    def check(self, key: str, value: Any, optional: bool) -> None:
        if value <= 0 and value != -1:
            raise ValueError(f"{key} must be positive or -1 (automatic), got {value}")


Positive = _Positive()
"""``> 0``."""

PositiveOrAuto = _PositiveOrAuto()
"""``> 0``, or ``-1`` for "derived automatically" (the field's docstring says from what)."""


@dataclass(frozen=True)
class AtLeast(Bound):
    """``>= low``."""

    low: float

    def check(self, key: str, value: Any, optional: bool) -> None:
        if value < self.low:
            raise ValueError(f"{key} must be >= {self.low}, got {value}")


@dataclass(frozen=True)
class AtMost(Bound):
    """``<= high``; ``why``: what sets the limit."""

    high: int
    why: str

    def check(self, key: str, value: Any, optional: bool) -> None:
        if value > self.high:
            raise ValueError(f"{key} must be at most {self.high} ({self.why}), got {value}")


@dataclass(frozen=True)
class InRange(Bound):
    """``low <= value <= high``; ``< high`` with ``high_open``, ``> low`` with ``low_open``."""

    low: float
    high: float
    high_open: bool = False
    low_open: bool = False

    def check(self, key: str, value: Any, optional: bool) -> None:
        below_high = value < self.high if self.high_open else value <= self.high
        above_low = value > self.low if self.low_open else value >= self.low
        if not (above_low and below_high):
            interval = f"{'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"
            raise ValueError(f"{key} must be in {interval}{' or unset' if optional else ''}, got {value}")


@dataclass(frozen=True)
class NonEmpty(Bound):
    """A list with at least one item; ``why``: what an empty one would mean, and the fix."""

    why: str

    def check(self, key: str, value: Any, optional: bool) -> None:
        if not value:
            raise ValueError(f"{key} is empty: {self.why}")


class _IncreasingPositive(Bound):
    def check(self, key: str, value: Any, optional: bool) -> None:
        if not value or any(b <= a for a, b in zip([0, *value], value)):
            raise ValueError(f"{key} must be increasing positive integers, got {value}")


IncreasingPositive = _IncreasingPositive()
"""A non-empty list of strictly increasing positive numbers."""


@dataclass(frozen=True)
class OneOf(Bound):
    """One of the names ``choices()`` returns (choices known only at run time, e.g. the model flavors)."""

    choices: Callable[[], Sequence[str]]

    def check(self, key: str, value: Any, optional: bool) -> None:
        check_choice(key, value, list(self.choices()))


def check_choice(key: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{key} must be one of {list(choices)}, got {value!r}{did_you_mean(value, choices)}")


# --------------------------------------------------------------------------------------------
# the walker


def split_hint(hint: Any) -> tuple[Any, tuple[Bound, ...]]:
    """``Annotated[T, b1, b2]`` -> ``(T, (b1, b2))``; any other hint -> ``(hint, ())``."""
    if typing.get_origin(hint) is Annotated:
        base, *meta = typing.get_args(hint)
        return base, tuple(b for b in meta if isinstance(b, Bound))
    return hint, ()


def optional_inner(hint: Any) -> Any | None:
    """``T | None`` -> ``T``; ``None`` for a hint that is not optional."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint):
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return None


def convert(key: str, value: Any, hint: Any, from_text: bool = False) -> Any:
    """``value`` for the field ``key`` annotated ``hint``: checked against the type and the bounds
    (``from_text``: a command-line string, parsed first). Returns the value, parsed from text or
    widened (an integer for a float field becomes a float); ``ValueError`` naming ``key``."""
    hint, bounds = split_hint(hint)
    inner = optional_inner(hint)
    if inner is not None:
        if value is None or (from_text and str(value).lower() in NONE_WORDS):
            return None
        hint, more = split_hint(inner)
        bounds += more
    value = _convert_type(key, value, hint, from_text)
    for bound in bounds:
        bound.check(key, value, optional=inner is not None)
    return value


def _convert_type(key: str, value: Any, hint: Any, from_text: bool) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        if not isinstance(value, str):
            raise ValueError(f"{key} must be one of {list(args)}, got {value!r}")
        check_choice(key, value, args)
        return value
    if origin is list:
        if from_text or isinstance(value, str):
            value = [v.strip() for v in str(value).split(",") if v.strip()]
        if not isinstance(value, list):
            raise ValueError(f"{key} must be a list (comma-separated on the command line), got {value!r}")
        return [convert(key, v, args[0], from_text) for v in value]
    if hint is bool:
        if isinstance(value, bool):
            return value
        if from_text and str(value).lower() in BOOL_WORDS:
            return BOOL_WORDS[str(value).lower()]
        raise ValueError(f"{key} must be true or false, got {value!r}")
    if hint in (int, float):
        return _convert_number(key, value, hint, from_text)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{key} must be a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(hint):  # a table, e.g. one [[training.mixture]] entry
        return _convert_table(key, value, hint, from_text)
    raise TypeError(f"unsupported config type {hint} for {key}")  # internal: a field type the walker lacks


def _convert_number(key: str, value: Any, hint: type[int] | type[float], from_text: bool) -> int | float:
    kind = "a float" if hint is float else "an integer"
    if isinstance(value, bool):
        raise ValueError(f"{key} must be {kind}, got {value!r}")
    if from_text:
        try:
            value = hint(value)
        except ValueError:
            raise ValueError(f"{key} must be {kind}, got {value!r}") from None
    if hint is float and isinstance(value, int):
        value = float(value)
    if not isinstance(value, (int, float)) or not isinstance(value, hint):
        raise ValueError(f"{key} must be {kind}, got {value!r}")
    if hint is float and not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {value!r}")
    if hint is int and not INT64[0] <= value <= INT64[1]:
        raise ValueError(f"{key} = {value} does not fit in 64 bits")
    return value


def _convert_table(key: str, value: Any, hint: Any, from_text: bool) -> Any:
    """A dataclass-typed value: a TOML table (dict), a command-line string (``hint.parse``), or an
    instance built in code (its fields checked)."""
    hints = typing.get_type_hints(hint, include_extras=True)  # a plain dataclass: its fields only
    if isinstance(value, hint):
        for name, field_hint in hints.items():
            convert(f"{key}.{name}", getattr(value, name), field_hint)
        return value
    if from_text or isinstance(value, str):
        value, from_text = hint.parse(key, str(value)), True
    if not isinstance(value, dict):
        raise ValueError(f"{key} entries must be tables, got {value!r}")
    for name in value:
        if name not in hints:
            raise ValueError(f"{key}: unknown key {name!r} in {value!r}{did_you_mean(name, hints)}")
    required = [f.name for f in dataclasses.fields(hint) if f.default is dataclasses.MISSING]
    missing = [name for name in required if name not in value]
    if missing:
        raise ValueError(f"{key}: entry {value!r} lacks {missing}")
    return hint(**{name: convert(f"{key}.{name}", v, hints[name], from_text) for name, v in value.items()})


# --------------------------------------------------------------------------------------------
# sections


class Section:
    """A TOML section, declared ``@dataclass class Training(Section, name="training")``: its keys
    are ``<name>.<field>``. :meth:`validate` checks every field against its annotation (type,
    choices, bounds), then the rules between the section's fields (:meth:`check`)."""

    NAME: typing.ClassVar[str]

    def __init_subclass__(cls, name: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.NAME = name

    @classmethod
    def hints(cls) -> dict[str, Any]:
        """Field name -> its annotation, bounds included."""
        hints = typing.get_type_hints(cls, include_extras=True)
        return {f.name: hints[f.name] for f in dataclasses.fields(typing.cast(Any, cls))}  # every Section: a dataclass

    def validate(self) -> None:
        """``ValueError`` naming the key for a value its annotation or the section's rules refuse."""
        for name, hint in self.hints().items():
            convert(f"{self.NAME}.{name}", getattr(self, name), hint)
        self.check()

    def check(self) -> None:
        """Rules between this section's fields, beyond each field's own bounds (none by default)."""
