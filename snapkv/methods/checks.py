"""Declarative parameter checks: what values one hyper-parameter takes (type, range, choices).

A method lists them by field name (`Method.checks`, merged along the class hierarchy, a subclass's
entry replacing its parent's); `Method` applies them before its own `validate()`, which keeps only
the checks that relate several fields. Every refusal reads `<name> must be <rule>, got
<name>=<value>`, so a bad value always names itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Check:
    """The values one parameter takes: `types` (a bool passes only where `bool` is listed; empty:
    any type), the bounds `low` / `high` (open when `low_open` / `high_open`), or `choices`
    (compared with their type: 1 is not True); `each`: a list or tuple whose every item passes.
    `none`: None passes; `needed`: None is refused as a missing value ("<method> needs a budget").
    `rule` is what the error message says a good value is."""

    rule: str
    types: tuple[type, ...] = ()
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[Any, ...] = ()
    each: bool = False
    none: bool = False
    needed: bool = False

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.none
        if self.each:
            return isinstance(value, list | tuple) and all(self._item(v) for v in value)
        return self._item(value)

    def _item(self, v: Any) -> bool:
        if self.choices:
            return any(type(v) is type(c) and v == c for c in self.choices)
        if self.types and (not isinstance(v, self.types) or (isinstance(v, bool) and bool not in self.types)):
            return False
        # Written as "not inside" so that NaN fails every bound.
        if self.low is not None and not (v > self.low if self.low_open else v >= self.low):
            return False
        return self.high is None or bool(v < self.high if self.high_open else v <= self.high)

    def error(self, name: str, value: Any, owner: str = "", prefix: str = "") -> ValueError:
        """The refusal of `value` for parameter `name` (`owner`: the method's name, for a missing
        needed value; `prefix`: how the parameter is reached, e.g. "decode_schedule.")."""
        if value is None and self.needed:
            return ValueError(f"{owner} needs a {name}, got {name}=None")
        return ValueError(f"{prefix}{name} must be {self.rule}, got {name}={value!r}")


def integer(low: int = 1, *, none: bool = False, needed: bool = False, rule: str | None = None) -> Check:
    """An int (not a bool) >= `low`: "a positive integer" (low 1) or "an integer >= low"."""
    default = "a positive integer" if low == 1 else f"an integer >= {low}"
    return Check(rule or default, types=(int,), low=low, none=none, needed=needed)


def number(
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    rule: str | None = None,
) -> Check:
    """An int or float (not a bool) within the bounds: "in [low, high]" or "a number >= low"."""
    if high is None:
        default = f"a number {'>' if low_open else '>='} {low}"
    else:
        default = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    return Check(
        rule or default, types=(int, float), low=low, high=high, low_open=low_open, high_open=high_open
    )


def one_of(choices: tuple[Any, ...], rule: str | None = None) -> Check:
    """One of `choices` (each compared with its type)."""
    return Check(rule or f"one of {choices}", choices=tuple(choices))


def flag() -> Check:
    """True or False (not 0 / 1, not a string)."""
    return Check("true or false", types=(bool,))


def check_all(checks: Mapping[str, Check | None], values: Any, owner: str = "", prefix: str = "") -> None:
    """ValueError for the first attribute of `values` that its check refuses (None: not checked)."""
    for name, check in checks.items():
        if check is not None:
            value = getattr(values, name)
            if not check.accepts(value):
                raise check.error(name, value, owner, prefix)
