"""Traffic from the first second: its records and its figures (measured by `first_second_run`).

Two fresh stacks are sent the same traffic, W1's greedy chat requests one after another for
a fixed span: the *first-second* stack from the moment its gateway answers, the *waited*
stack only once its services have loaded their deferred compiled graphs and a settle has
passed, alternating speculative and plain requests as W1 does. Times are seconds after the
stack answered (t); each stack's window is the requests that start `window_s` or more after
its traffic began (for the first-second stack: at t + `window_s` or later).

A speculative request *drafts* when at least `DRAFTING_SHARE` of its decode rounds drafted
with the draft model: a planner that keeps the model draft off still probes it now and
then, and a probe's few draft tokens are not drafting. *Startup-to-drafting* is the start of
the first request from which on every speculative request of the span drafted (None, "never",
when the span's last one did not); a speculative request that failed did not draft.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specdec_bench.spread import Spread
from specdec_bench.workloads import RunRecord

#: The stacks, by name: sent requests the moment it answered / after its graphs loaded.
FIRST_SECOND = "first-second"
WAITED = "waited"
#: Least share of a request's decode rounds drafted with the model for it to count as drafting.
DRAFTING_SHARE = 0.5


@dataclass
class FailedRequest:
    """A request of the scenario that ended with an error instead of its tokens."""

    #: Seconds after t.
    start_s: float
    prompt: int
    #: 0 = plain, None = speculative.
    k: int | None
    #: The gRPC status code's name, or the message of a request that ended without its tokens.
    error: str


@dataclass
class StackTraffic:
    """One fresh stack of the scenario and the requests it was sent."""

    name: str
    #: Seconds from t until its traffic began: 0 for the first-second stack, the end of the
    #: settle for the waited one. Its span and window count from here.
    traffic_from_s: float
    #: Compiled graphs the target and the draft still had to load when the stack answered.
    pending_graphs: dict[str, int]
    #: Seconds from t until both services reported none pending (None: not within the span).
    graphs_loaded_s: float | None
    #: In order; each with `start_s`, seconds after t.
    requests: list[RunRecord] = field(default_factory=list)
    failures: list[FailedRequest] = field(default_factory=list)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StackTraffic:
        return cls(**{**raw, "requests": [RunRecord(**r) for r in raw["requests"]],
                      "failures": [FailedRequest(**f) for f in raw.get("failures", [])]})


@dataclass
class FirstSecondRun:
    """The scenario's stacks with when, where and how it ran (`meta`: command, date, machine, config)."""

    meta: dict[str, Any]
    stacks: list[StackTraffic]
    #: Greedy speculative outputs compared with the waited stack's plain output of the same
    #: prompt, and those that differed.
    greedy_checked: int = 0
    greedy_mismatches: int = 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> FirstSecondRun:
        return cls(**{**raw, "stacks": [StackTraffic.from_dict(s) for s in raw["stacks"]]})

    def stack(self, name: str) -> StackTraffic | None:
        return next((s for s in self.stacks if s.name == name), None)


def _start(record: RunRecord) -> float:
    if record.start_s is None:
        raise ValueError(f"a {record.phase} request has no start time")
    return record.start_s


def in_window(requests: Sequence[RunRecord], since_s: float) -> list[RunRecord]:
    """The requests that started `since_s` seconds after t or later."""
    return [r for r in requests if _start(r) >= since_s]


def model_rounds_share(record: RunRecord) -> float:
    """Share of the request's decode rounds that drafted with the draft model (NaN without rounds)."""
    rounds = record.num_rounds + (record.num_plain_rounds or 0)
    return (record.num_rounds - record.num_lookup_rounds) / rounds if rounds else math.nan


def is_drafting(record: RunRecord) -> bool:
    return model_rounds_share(record) >= DRAFTING_SHARE


def drafting_since(points: Sequence[tuple[float, bool]]) -> float | None:
    """From (start time, drafted) in start order: the start of the first point from which on
    every point drafted; None when the last did not (or there is none)."""
    since = None
    for start, drafted in points:
        if not drafted:
            since = None
        elif since is None:
            since = start
    return since


def startup_to_drafting(stack: StackTraffic) -> float | None:
    """Seconds from t until the model draft drafts in every speculative request that follows
    (requests without a decode round, ended by their first token, say nothing either way;
    a failed one did not draft)."""
    points = [(_start(r), is_drafting(r)) for r in stack.requests
              if r.k is None and not math.isnan(model_rounds_share(r))]
    points += [(f.start_s, False) for f in stack.failures if f.k is None]
    return drafting_since(sorted(points))


@dataclass
class StackRow:
    """One stack and mode in the window."""

    stack: str
    mode: str
    tokens_per_s: Spread
    #: Share of the window's decode rounds drafted with the model (NaN for plain).
    speculating: float
    traffic_from_s: float
    pending_graphs: dict[str, int]
    graphs_loaded_s: float | None
    #: `startup_to_drafting` (speculative rows only; None: never).
    drafting_from_s: float | None
    #: Requests of this stack and mode that failed, over the whole span.
    failed: int = 0


@dataclass
class FirstSecondSummary:
    """The scenario's figures: each stack's window tokens/s and the ratios of their medians."""

    cpu: str
    span_s: float
    window_s: float
    rows: list[StackRow]
    vs_plain: float
    vs_waited: float
    waited_vs_plain: float
    #: The first-second stack's `startup_to_drafting` (None: never within the span).
    startup_to_drafting_s: float | None

    def row(self, stack: str, mode: str) -> StackRow | None:
        return next((r for r in self.rows if (r.stack, r.mode) == (stack, mode)), None)

    def final_line(self) -> str:
        drafting = self.startup_to_drafting_s
        return (f"first_second_vs_plain={self.vs_plain:.3f} first_second_vs_waited={self.vs_waited:.3f} "
                f"startup_to_drafting_s={'never' if drafting is None else f'{drafting:.1f}'}")


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 and not math.isnan(b) else math.nan


def _speculating(records: Sequence[RunRecord]) -> float:
    rounds = sum(r.num_rounds + (r.num_plain_rounds or 0) for r in records)
    return _ratio(sum(r.num_rounds - r.num_lookup_rounds for r in records), rounds)


def summarize_first_second(run: FirstSecondRun) -> FirstSecondSummary:
    """Window tokens/s (medians of the gateway's per-request decode tokens/s) per stack and mode."""
    config, machine = run.meta.get("config", {}), run.meta.get("machine", {})
    span_s, window_s = float(config.get("span_s", math.nan)), float(config.get("window_s", math.nan))
    rows = []
    for stack in run.stacks:
        window = in_window(stack.requests, stack.traffic_from_s + window_s)
        for k, mode in ((None, "speculative"), (0, "plain")):
            records = [r for r in window if r.k == k]
            failed = sum(f.k == k for f in stack.failures)
            if not records and not failed and not any(r.k == k for r in stack.requests):
                continue
            rows.append(StackRow(
                stack.name, mode, Spread.of([r.tokens_per_s for r in records]),
                _speculating(records) if k is None else math.nan, stack.traffic_from_s, stack.pending_graphs,
                stack.graphs_loaded_s, startup_to_drafting(stack) if k is None else None, failed,
            ))

    def median(stack: str, mode: str) -> float:
        row = next((r for r in rows if (r.stack, r.mode) == (stack, mode)), None)
        return row.tokens_per_s.median if row is not None else math.nan

    first, plain, waited = median(FIRST_SECOND, "speculative"), median(WAITED, "plain"), median(WAITED, "speculative")
    first_stack = run.stack(FIRST_SECOND)
    return FirstSecondSummary(
        cpu=f"{machine.get('cpu_model', '?')}, {machine.get('cpus', '?')} logical CPUs", span_s=span_s,
        window_s=window_s, rows=rows, vs_plain=_ratio(first, plain), vs_waited=_ratio(first, waited),
        waited_vs_plain=_ratio(waited, plain),
        startup_to_drafting_s=startup_to_drafting(first_stack) if first_stack is not None else None,
    )
