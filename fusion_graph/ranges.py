"""Field metadata shared by operator settings and run context: finite ranges with readable errors."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BeforeValidator, Field


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None  # not a number: pydantic's own type error says so


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"must be a number, got the boolean {value!r}")
    return value


def between(low: float, high: float) -> tuple[Any, ...]:
    """Range metadata: a message naming the whole valid range, and bounds Studio shows."""

    def check(value: Any) -> Any:
        _no_bool(value)
        number = _number(value)
        if number is not None and (math.isnan(number) or number < low or number > high):
            raise ValueError(f"must be between {low:g} and {high:g}, got {value!r}")
        return value

    return (Field(ge=low, le=high, allow_inf_nan=False), BeforeValidator(check))


def seconds(high: float = 3600.0) -> tuple[Any, ...]:
    """Metadata for a duration: greater than 0 and at most ``high`` seconds (never infinite)."""

    def check(value: Any) -> Any:
        _no_bool(value)
        number = _number(value)
        if number is not None and not (0 < number <= high):
            raise ValueError(f"must be greater than 0 and at most {high:g} seconds, got {value!r}")
        return value

    return (Field(gt=0, le=high, allow_inf_nan=False), BeforeValidator(check))


#: The largest price (USD per million tokens) accepted: far above any real model, never infinite.
MAX_PRICE = 10_000.0


def price(value: Any) -> Any:
    """A price in USD per million tokens: finite, 0 or more, at most ``MAX_PRICE``."""
    _no_bool(value)
    number = _number(value)
    if number is None or math.isnan(number) or not (0 <= number <= MAX_PRICE):
        raise ValueError(f"prices must be between 0 and {MAX_PRICE:g} USD per million tokens, got {value!r}")
    return number
