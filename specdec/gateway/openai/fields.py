"""Typed reads of a JSON body's fields: each returns None when the field is absent and raises a
400 naming the field (`prefix` + name) when it has the wrong type or range."""

from __future__ import annotations

import math
from typing import Any

from specdec.gateway.openai.errors import invalid_field

INT32_MAX = 2**31 - 1


def json_type(value: object) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def boolean(container: dict[str, Any], name: str, prefix: str = "") -> bool | None:
    value = container.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise invalid_field(prefix + name, f"must be a boolean, got {json_type(value)}")


def number(container: dict[str, Any], name: str, prefix: str = "") -> float | None:
    value = container.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid_field(prefix + name, f"must be a finite number, got {json_type(value)}")
    return float(value)


def integer(container: dict[str, Any], name: str, prefix: str = "", *, low: int = -INT32_MAX - 1,
             high: int | None = None) -> int | None:
    """An integer field in [low, high] (no upper bound when `high` is None: callers cap it)."""
    value = container.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 16.0 is 16 to JSON
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_field(prefix + name, f"must be an integer, got {json_type(value)}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise invalid_field(prefix + name, f"must be {bounds}, got {value}")
    return value
