"""Adaptive K against the best fixed K in hindsight (`--fixed-k`; issue 55: within 5 %).

W1 runs every prompt and temperature in each mode back to back, and the concurrency sweep
each level's modes in turn. Adaptive K is compared with each fixed K (plain, K = 0, counts as
one) by the median of its ratios within a *pair group*: the requests of one prompt and
repetition (W1), or the groups of one level's repetition (concurrency), which ran a few
seconds apart. The best fixed K is the one adaptive K does worst against.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass

from specdec_bench.sweeps import ConcurrencyGroup
from specdec_bench.workloads import RunRecord

#: Issue 55's target: adaptive K at least this share of the best fixed K.
MARGIN = 0.95

#: Tokens/s per mode (0 plain, None adaptive, K fixed) of each pair group.
PairGroups = Collection[Mapping[int | None, float]]


@dataclass
class VsFixedK:
    """Adaptive K ÷ each fixed K, and ÷ the best of them, on one part of the run."""

    where: str
    best_k: int
    #: Adaptive ÷ the best fixed K (the smallest of `by_k`).
    ratio: float
    #: Adaptive ÷ K for every fixed K measured (0 = plain): medians over the pair groups.
    by_k: dict[int, float]

    @property
    def met(self) -> bool:
        return self.ratio >= MARGIN


def versus_best(where: str, groups: PairGroups) -> VsFixedK | None:
    """Adaptive ÷ each fixed K over the pair groups that have both; None without a fixed K > 0."""
    ks = sorted({k for rates in groups for k in rates if k is not None})
    by_k: dict[int, float] = {}
    for k in ks:
        ratios = [rates[None] / rates[k] for rates in groups
                  if rates.get(None) is not None and rates.get(k, 0.0) > 0]
        if ratios:
            by_k[k] = statistics.median(ratios)
    if not any(k > 0 for k in by_k):
        return None
    best_k = min(by_k, key=lambda k: by_k[k])
    return VsFixedK(where, best_k, by_k[best_k], by_k)


def w1_vs_fixed_k(records: Sequence[RunRecord], temperature: float, where: str) -> VsFixedK | None:
    """W1's requests at `temperature`, paired by prompt and repetition."""
    groups: dict[Hashable, dict[int | None, float]] = {}
    for r in records:
        if r.temperature == temperature:
            groups.setdefault((r.prompt, r.repetition), {})[r.k] = r.tokens_per_s
    return versus_best(where, groups.values())


def concurrency_vs_fixed_k(groups: Sequence[ConcurrencyGroup]) -> list[VsFixedK]:
    """Per level: its groups paired by repetition (the i-th group of each mode)."""
    seen: dict[tuple[int, int | None], int] = {}
    by_level: dict[int, dict[Hashable, dict[int | None, float]]] = {}
    for g in groups:
        rep = seen.get((g.concurrency, g.k), 0)
        seen[(g.concurrency, g.k)] = rep + 1
        by_level.setdefault(g.concurrency, {}).setdefault(rep, {})[g.k] = g.tokens_per_s
    rows = (versus_best(f"{level} request{'s' if level > 1 else ''}", pairs.values())
            for level, pairs in sorted(by_level.items()))
    return [row for row in rows if row is not None]


def vs_fixed_k(w1: Sequence[RunRecord], temperature: float, groups: Sequence[ConcurrencyGroup]) -> list[VsFixedK]:
    """W1 greedy, W1 sampled and every concurrency level (parts without a fixed K are left out)."""
    parts = [w1_vs_fixed_k(w1, 0.0, "W1 greedy"), w1_vs_fixed_k(w1, temperature, f"W1 T={temperature:g}")]
    return [p for p in parts if p is not None] + concurrency_vs_fixed_k(groups)
