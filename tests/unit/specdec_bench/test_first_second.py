"""Traffic from the first second, on synthetic records: the window, startup-to-drafting, the
summary, the flags and the page. No services, no models, no clocks."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
from pathlib import Path
from typing import Any

import pytest

from specdec.cost_model import ForwardCost
from specdec.errors import InvalidArgumentError
from specdec_bench.analysis import summarize
from specdec_bench.config import FULL, QUICK, add_bench_flags, config_from_args
from specdec_bench.first_second import (
    FIRST_SECOND,
    WAITED,
    FailedRequest,
    FirstSecondRun,
    StackTraffic,
    drafting_since,
    in_window,
    is_drafting,
    startup_to_drafting,
    summarize_first_second,
)
from specdec_bench.first_second_run import traffic_plan
from specdec_bench.report import first_second_table, render_page
from specdec_bench.results import BenchResults, ServiceCosts
from specdec_bench.workloads import RunRecord


def _request(start_s: float | None, rate: float, *, k: int | None = None, drafted_rounds: int = 30,
             plain_rounds: int = 2, **extra: Any) -> RunRecord:
    """A 128-token request started `start_s` after t; speculative (K None) unless `k` is 0."""
    speculative = k is None
    fields: dict[str, Any] = dict(
        phase=FIRST_SECOND, prompt=0, k=k, temperature=0.0, repetition=0, tokens_per_s=rate,
        time_to_first_token_s=0.1, total_s=4.0, completion_tokens=128,
        num_rounds=drafted_rounds if speculative else 0, num_draft_tokens=4 * drafted_rounds if speculative else 0,
        num_accepted_tokens=3 * drafted_rounds if speculative else 0, anatomy={},
        num_plain_rounds=plain_rounds if speculative else 127, start_s=start_s,
    )
    return RunRecord(**{**fields, **extra})


def _probing(start_s: float, rate: float) -> RunRecord:
    """Speculation kept off: 120 plain rounds, and 4 probes of 2 draft tokens."""
    return _request(start_s, rate, drafted_rounds=4, plain_rounds=120)


def test_window_keeps_the_requests_that_start_at_its_edge_or_later() -> None:
    requests = [_request(s, 10.0) for s in (0.0, 30.0, 59.9, 60.0, 75.0)]
    assert [r.start_s for r in in_window(requests, 60.0)] == [60.0, 75.0]
    assert in_window(requests, 80.0) == []


def test_drafting_since_is_the_start_of_the_last_unbroken_run_of_drafting_requests() -> None:
    assert drafting_since([(0.0, True), (5.0, True)]) == 0.0
    assert drafting_since([(0.0, False), (5.0, True), (9.0, False), (14.0, True), (20.0, True)]) == 14.0
    assert drafting_since([(0.0, True), (5.0, False)]) is None  # stopped drafting: never (steadily)
    assert drafting_since([(0.0, False), (5.0, False)]) is None
    assert drafting_since([]) is None


def test_a_request_drafts_when_half_its_rounds_drafted_with_the_model() -> None:
    assert is_drafting(_request(0.0, 10.0, drafted_rounds=30, plain_rounds=2))
    assert is_drafting(_request(0.0, 10.0, drafted_rounds=10, plain_rounds=10))
    assert not is_drafting(_probing(0.0, 10.0))  # probes are not drafting
    # Rounds a lookup drafted are not the model draft's.
    assert not is_drafting(_request(0.0, 10.0, drafted_rounds=30, plain_rounds=2, num_lookup_rounds=20))
    assert not is_drafting(_request(0.0, 10.0, k=0))


def test_startup_to_drafting_reads_the_speculative_requests_only() -> None:
    stack = StackTraffic(WAITED, 65.0, {"target": 3, "draft": 4}, 60.0, [
        _request(65.0, 10.0, k=0), _probing(69.0, 10.0), _request(72.0, 15.0), _request(76.0, 10.0, k=0),
        # Ended by its first token: no decode round, it says nothing either way.
        _request(80.0, 0.0, drafted_rounds=0, plain_rounds=0, completion_tokens=1),
        _request(81.0, 16.0),
    ])
    assert startup_to_drafting(stack) == 72.0
    never = StackTraffic(FIRST_SECOND, 0.0, {}, None, [_request(0.0, 15.0), _probing(5.0, 10.0)])
    assert startup_to_drafting(never) is None
    # A speculative request that failed did not draft; a plain one says nothing.
    failed = StackTraffic(FIRST_SECOND, 0.0, {}, None, [_request(0.0, 15.0), _request(9.0, 15.0)],
                          [FailedRequest(4.0, 1, None, "DEADLINE_EXCEEDED"), FailedRequest(12.0, 2, 0, "UNAVAILABLE")])
    assert startup_to_drafting(failed) == 9.0


def _run() -> FirstSecondRun:
    # First-second: drafts at first (eager, the planner guesses), locked off from t + 8 s to
    # t + 40 s, drafting from 40 s on. Window from t + 60 s: 18 and 20 tok/s.
    first = StackTraffic(FIRST_SECOND, 0.0, {"target": 5, "draft": 6}, 35.0, [
        _request(0.01, 12.0), _probing(8.0, 9.0), _probing(20.0, 10.0), _request(40.0, 17.0),
        _request(55.0, 18.0), _request(60.0, 18.0), _request(70.0, 20.0),
    ], [FailedRequest(30.0, 1, None, "DEADLINE_EXCEEDED")])
    # Waited: traffic from t + 40 s, so its window starts at t + 100 s; plain 10 and 12, speculative 24.
    waited = StackTraffic(WAITED, 40.0, {"target": 5, "draft": 6}, 34.5, [
        _request(40.0, 30.0, k=0, phase=WAITED), _request(44.0, 30.0, phase=WAITED),
        _request(100.0, 10.0, k=0, phase=WAITED), _request(104.0, 24.0, phase=WAITED),
        _request(108.0, 12.0, k=0, phase=WAITED),
    ])
    meta = {"command": "specdec bench --first-second only", "date": "2026-12-01 10:00 UTC", "duration_s": 400.0,
            "machine": {"cpu_model": "Test CPU 9000", "cpus": 2, "git": "abc1234"},
            "config": {"span_s": 90.0, "window_s": 60.0, "settle_s": 5.0, "prompts": 6, "max_new_tokens": 128}}
    return FirstSecondRun(meta, [waited, first], greedy_checked=9, greedy_mismatches=0)


def test_summary_takes_each_stacks_window_from_its_first_request() -> None:
    fs = summarize_first_second(_run())
    first, waited, plain = (fs.row(FIRST_SECOND, "speculative"), fs.row(WAITED, "speculative"),
                            fs.row(WAITED, "plain"))
    assert first is not None and waited is not None and plain is not None
    assert fs.row(FIRST_SECOND, "plain") is None  # the first-second stack sends no plain request
    assert (first.tokens_per_s.n, first.tokens_per_s.median) == (2, 19.0)
    assert (waited.tokens_per_s.n, waited.tokens_per_s.median) == (1, 24.0)
    assert (plain.tokens_per_s.n, plain.tokens_per_s.median) == (2, 11.0)
    assert fs.vs_plain == pytest.approx(19.0 / 11.0) and fs.vs_waited == pytest.approx(19.0 / 24.0)
    assert fs.waited_vs_plain == pytest.approx(24.0 / 11.0)
    assert fs.startup_to_drafting_s == 40.0 and waited.drafting_from_s == 44.0
    assert (first.failed, waited.failed, plain.failed) == (1, 0, 0)
    assert first.speculating == pytest.approx(60 / 64)
    assert fs.final_line() == "first_second_vs_plain=1.727 first_second_vs_waited=0.792 startup_to_drafting_s=40.0"
    assert fs.cpu == "Test CPU 9000, 2 logical CPUs"


def test_never_drafting_is_reported_as_never_not_as_the_span() -> None:
    run = _run()
    run.stacks[1].requests.append(_probing(80.0, 10.0))
    fs = summarize_first_second(run)
    assert fs.startup_to_drafting_s is None
    assert fs.final_line().endswith("startup_to_drafting_s=never")
    assert "| startup-to-drafting (first-second stack) | never |" in first_second_table(fs)


def test_page_names_the_cpu_and_the_json_round_trips(tmp_path: Path) -> None:
    costs = ServiceCosts(target=[ForwardCost(1, 1, 0.05), ForwardCost(1, 5, 0.07)], draft=[ForwardCost(1, 1, 0.01)],
                         default_num_speculative_tokens=4, max_speculative_tokens=8, adaptive_k=True)
    w1 = [_request(None, 10.0, k=0, phase="w1"), _request(None, 15.0, phase="w1")]
    path = tmp_path / "bench.json"
    BenchResults({"config": {}}, costs, w1, first_second=_run()).save(path)
    loaded = BenchResults.load(path)
    assert loaded.first_second == _run()
    summary = summarize(loaded)
    plots = {name: tmp_path / f"{name}.png" for name in
             ("speedup_vs_k", "throughput_vs_concurrency", "acceptance_by_position", "round_anatomy")}
    page = render_page(loaded, summary, plots, tmp_path / "benchmarks.md", path)
    section = page[page.index("## Traffic from the first second"):]
    assert "CPU: **Test CPU 9000, 2 logical CPUs**" in section
    assert "| first-second ÷ plain | 1.727× |" in section and "| first-second ÷ waited | 0.792× |" in section
    assert "| waited | plain | 11.0 | 10.0–12.0 | 2 |" in section
    row = "| first-second | speculative | 19.0 | 18.0–20.0 | 2 | 94 % | 0.0 s | 5 / 6 | 35.0 s | 40.0 s | 1 |"
    assert row in section
    # Without the scenario there is no section.
    without = dataclasses.replace(loaded, first_second=None)
    assert "first second" not in render_page(without, summarize(without), plots, tmp_path / "b.md", path).lower()


def test_first_second_flags_and_presets() -> None:
    parser = argparse.ArgumentParser()
    add_bench_flags(parser)
    assert FULL.first_second == "on" and QUICK.first_second == "off"
    config = config_from_args(parser.parse_args(
        ["--quick", "--first-second", "only", "--first-second-span-s", "30", "--first-second-window-s", "15"]))
    assert (config.first_second, config.first_second_span_s, config.first_second_window_s) == ("only", 30.0, 15.0)
    with pytest.raises(SystemExit):
        parser.parse_args(["--first-second", "sometimes"])
    with pytest.raises(InvalidArgumentError, match="first_second_window_s"):
        dataclasses.replace(FULL, first_second_span_s=60.0, first_second_window_s=60.0)
    with pytest.raises(InvalidArgumentError, match="render_only"):
        dataclasses.replace(FULL, first_second="only", render_only=True)


def test_plan_cycles_the_prompts_and_alternates_plain_and_speculative_on_the_waited_stack() -> None:
    assert list(itertools.islice(traffic_plan(3, plain_too=False), 4)) == [(0, None), (1, None), (2, None), (0, None)]
    assert list(itertools.islice(traffic_plan(3, plain_too=True), 6)) == [(0, 0), (0, None), (1, None), (1, 0), (2, 0),
                                                                    (2, None)]


def test_nan_ratios_without_a_plain_window() -> None:
    run = _run()
    run.stacks[0].requests = [r for r in run.stacks[0].requests if r.k is None]
    fs = summarize_first_second(run)
    assert math.isnan(fs.vs_plain) and fs.row(WAITED, "plain") is None
