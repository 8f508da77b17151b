"""A noisy-neighbour burst: its records and figures (measured by `burst_run`; `--burst-s`).

Single greedy requests run one after another, speculative in one pass and plain in the
next. Each pass runs steady for `LEAD_S` seconds and at least `MIN_BEFORE` requests, then
`burst_s` seconds with two busy processes taking both cores (started between two
requests), then `TAIL_S` seconds more. Times are seconds after the pass began. A request
counts *before* when it ended before the burst began, *during* when it overlapped the
burst, *after* when it started once the burst had ended. A request that fails (a service's
deadline passes on a crowded machine) is counted, and is not back at speed.

*Recovery* (issue 55: within `TARGET_S`): seconds from the burst's end to the start of the
first `RUN` consecutive requests after it whose median tokens/s is at least `SHARE` of the
median before the burst (a median of a few, so that one fast request does not count as
recovered on a machine whose requests scatter by ±10 %).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specdec_bench.first_second import FailedRequest
from specdec_bench.spread import Spread
from specdec_bench.workloads import RunRecord

#: Seconds of steady requests before the burst (and at least this many requests), and after it.
LEAD_S = 20.0
MIN_BEFORE = 5
TAIL_S = 30.0
#: Recovered: back to this share of the median before the burst ...
SHARE = 0.95
#: ... over this many consecutive requests (their median) ...
RUN = 3
#: ... within this many seconds of the burst's end.
TARGET_S = 15.0


@dataclass
class BurstPass:
    """One pass through a burst: its mode's requests and when the burst began and ended."""

    #: 0 = plain, None = speculative (adaptive K).
    k: int | None
    burst_from_s: float
    burst_to_s: float
    #: In order; each with `start_s`, seconds after the pass began.
    requests: list[RunRecord] = field(default_factory=list)
    #: Requests that ended with an error (`start_s` as above).
    failures: list[FailedRequest] = field(default_factory=list)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> BurstPass:
        return cls(**{**raw, "requests": [RunRecord(**r) for r in raw["requests"]],
                      "failures": [FailedRequest(**f) for f in raw.get("failures", [])]})


@dataclass
class BurstRun:
    """The scenario's passes with its settings (`meta`: burst_s, lead_s, tail_s, hogs)."""

    meta: dict[str, Any]
    passes: list[BurstPass]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> BurstRun:
        return cls(raw["meta"], [BurstPass.from_dict(p) for p in raw["passes"]])


def _start(r: RunRecord) -> float:
    if r.start_s is None:
        raise ValueError(f"a {r.phase} request has no start time")
    return r.start_s


def recovery_s(points: Sequence[tuple[float, float]], burst_to_s: float, baseline: float,
               share: float = SHARE, run: int = RUN) -> float | None:
    """From (start time, tokens/s) in start order: seconds from `burst_to_s` to the start of the
    first `run` consecutive points started at or after it whose median is at least `share` ×
    `baseline`; None when no such run (or no baseline)."""
    if math.isnan(baseline):
        return None
    after = [(start, rate) for start, rate in points if start >= burst_to_s]
    for i in range(len(after) - run + 1):
        if statistics.median(rate for _, rate in after[i:i + run]) >= share * baseline:
            return after[i][0] - burst_to_s
    return None


def _drafting(records: Sequence[RunRecord]) -> float:
    """Share of the decode rounds that drafted (NaN without rounds)."""
    rounds = sum(r.num_rounds + (r.num_plain_rounds or 0) for r in records)
    return sum(r.num_rounds for r in records) / rounds if rounds else math.nan


@dataclass
class BurstRow:
    """One pass: tokens/s before, during and after the burst (from its end + `TARGET_S`)."""

    mode: str
    before: Spread
    during: Spread
    after: Spread
    #: `recovery_s` against the median before (None: not within the pass).
    recovery_s: float | None
    #: Share of decode rounds that drafted, before / during / after (NaN for plain).
    drafting: tuple[float, float, float]
    #: Requests of the pass that failed.
    failed: int = 0

    @property
    def met(self) -> bool:
        return self.recovery_s is not None and self.recovery_s <= TARGET_S


def burst_row(p: BurstPass) -> BurstRow:
    """The figures of one pass."""
    before = [r for r in p.requests if _start(r) + r.total_s <= p.burst_from_s]
    during = [r for r in p.requests if _start(r) < p.burst_to_s and _start(r) + r.total_s > p.burst_from_s]
    after = [r for r in p.requests if _start(r) >= p.burst_to_s]
    settled = [r for r in after if _start(r) >= p.burst_to_s + TARGET_S]
    baseline = Spread.of([r.tokens_per_s for r in before])
    points = sorted([(_start(r), r.tokens_per_s) for r in after] + [(f.start_s, 0.0) for f in p.failures])
    return BurstRow(
        "plain" if p.k == 0 else "speculative", baseline, Spread.of([r.tokens_per_s for r in during]),
        Spread.of([r.tokens_per_s for r in settled]), recovery_s(points, p.burst_to_s, baseline.median),
        (_drafting(before), _drafting(during), _drafting(settled)) if p.k != 0 else (math.nan,) * 3,
        len(p.failures),
    )


@dataclass
class BurstSummary:
    burst_s: float
    rows: list[BurstRow]

    def row(self, mode: str) -> BurstRow | None:
        return next((r for r in self.rows if r.mode == mode), None)


def summarize_burst(run: BurstRun) -> BurstSummary:
    return BurstSummary(float(run.meta.get("burst_s", math.nan)), [burst_row(p) for p in run.passes])
