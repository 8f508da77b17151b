"""Median, extremes and quartiles of a sample: how the harness quotes every speed."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class Spread:
    """Median, extremes and quartiles of a sample."""

    n: int
    median: float
    min: float
    max: float
    q1: float
    q3: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        return cls(len(values), statistics.median(values), min(values), max(values),
                   percentile(values, 25), percentile(values, 75))
