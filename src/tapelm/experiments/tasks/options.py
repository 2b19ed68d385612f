"""Validation of task options: each check raises ValueError naming the option and its allowed range."""

from __future__ import annotations

from collections.abc import Iterable
from numbers import Integral, Real


def _reject(name: str, value: object, rule: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not allowed; it must be {rule}")


def check_int(name: str, value: object, low: int, high: int) -> int:
    """`value` as an int in [low, high]."""
    if not isinstance(value, Integral) or isinstance(value, bool) or not low <= value <= high:
        raise _reject(name, value, f"an integer in [{low}, {high}]")
    return int(value)


def check_float(name: str, value: object, low: float, high: float) -> float:
    """`value` as a float in [low, high]."""
    if not isinstance(value, Real) or isinstance(value, bool) or not low <= value <= high:
        raise _reject(name, value, f"a number in [{low}, {high}]")
    return float(value)


def check_multipliers(name: str, values: Iterable[object], high: int = 64) -> tuple[int, ...]:
    """A non-empty set of integer length multipliers in [1, high], sorted."""
    values = tuple(values)
    if not values or not all(isinstance(v, Integral) and not isinstance(v, bool) and 1 <= v <= high for v in values):
        raise _reject(name, values, f"a non-empty sequence of integers in [1, {high}]")
    return tuple(sorted({int(v) for v in values}))


def check_fractions(name: str, values: Iterable[object]) -> tuple[float, ...]:
    """A non-empty set of numbers in [0, 1], sorted."""
    values = tuple(values)
    if not values or not all(isinstance(v, Real) and not isinstance(v, bool) and 0 <= v <= 1 for v in values):
        raise _reject(name, values, "a non-empty sequence of numbers in [0, 1]")
    return tuple(sorted({float(v) for v in values}))


def check_choice(name: str, value: object, allowed: Iterable[str]) -> str:
    """`value` as one of `allowed`."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise _reject(name, value, f"one of: {', '.join(allowed)}")
    return str(value)
