"""Issue 55's bench figures on synthetic records: adaptive K against the best fixed K, and the
recovery after a CPU burst. No services, no models, no clocks."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

from specdec.cost_model import ForwardCost
from specdec.errors import InvalidArgumentError
from specdec_bench.analysis import summarize
from specdec_bench.burst import TARGET_S, BurstPass, BurstRun, burst_row, recovery_s
from specdec_bench.config import QUICK
from specdec_bench.first_second import FailedRequest
from specdec_bench.report import render_page, summary_table
from specdec_bench.results import BenchResults, ServiceCosts
from specdec_bench.sweeps import ConcurrencyGroup, modes
from specdec_bench.vs_fixed_k import concurrency_vs_fixed_k, versus_best, w1_vs_fixed_k
from specdec_bench.workloads import RunRecord


def _run(k: int | None, rate: float, *, prompt: int = 0, rep: int = 0, temperature: float = 0.0,
         **extra: Any) -> RunRecord:
    fields: dict[str, Any] = dict(
        phase="w1", prompt=prompt, k=k, temperature=temperature, repetition=rep, tokens_per_s=rate,
        time_to_first_token_s=0.1, total_s=1.0, completion_tokens=48, num_rounds=10 if k != 0 else 0,
        num_draft_tokens=0, num_accepted_tokens=0, anatomy={}, num_plain_rounds=0 if k != 0 else 47,
    )
    return RunRecord(**{**fields, **extra})


def test_adaptive_is_compared_pairwise_with_the_fixed_k_it_does_worst_against() -> None:
    # Two pair groups: adaptive ÷ K=4 is 1.0 and 0.9 (median 0.95), ÷ K=8 1.2 and 1.1, ÷ plain 2.
    groups: list[dict[int | None, float]] = [{None: 90.0, 0: 45.0, 4: 90.0, 8: 75.0},
                                             {None: 99.0, 0: 49.5, 4: 110.0, 8: 90.0}]
    row = versus_best("W1 greedy", groups)
    assert row is not None and row.best_k == 4 and row.ratio == pytest.approx(0.95) and row.met
    assert row.by_k[8] == pytest.approx(1.15) and row.by_k[0] == pytest.approx(2.0)
    # Without a fixed K > 0 there is nothing to compare with but plain: that is the speedup.
    assert versus_best("W1", [{None: 2.0, 0: 1.0}]) is None
    # A group whose adaptive request is missing says nothing.
    assert versus_best("W1", [{0: 1.0, 4: 2.0}]) is None


def test_w1_pairs_by_prompt_and_repetition_at_one_temperature() -> None:
    records = [_run(None, 40.0, prompt=0), _run(4, 50.0, prompt=0), _run(None, 60.0, prompt=1),
               _run(4, 50.0, prompt=1), _run(None, 10.0, prompt=0, temperature=0.8),
               _run(4, 50.0, prompt=0, temperature=0.8)]
    greedy = w1_vs_fixed_k(records, 0.0, "W1 greedy")
    assert greedy is not None and greedy.ratio == pytest.approx((0.8 + 1.2) / 2) and greedy.met
    sampled = w1_vs_fixed_k(records, 0.8, "W1 T=0.8")
    assert sampled is not None and sampled.ratio == pytest.approx(0.2)


def test_concurrency_pairs_the_ith_group_of_each_mode_per_level() -> None:
    def group(level: int, k: int | None, wall_s: float) -> ConcurrencyGroup:
        return ConcurrencyGroup(level, k, wall_s, [_run(k, 1.0, completion_tokens=100)])

    # Level 4: repetition 0 adaptive 100 vs K=8 50 tok/s, repetition 1 adaptive 50 vs 100.
    groups = [group(4, 0, 2.0), group(4, None, 1.0), group(4, 8, 2.0),
              group(4, 8, 1.0), group(4, None, 2.0), group(4, 0, 2.0), group(1, None, 1.0)]
    rows = concurrency_vs_fixed_k(groups)
    assert [r.where for r in rows] == ["4 requests"]  # level 1 ran no fixed K
    assert rows[0].by_k[8] == pytest.approx((2.0 + 0.5) / 2) and rows[0].best_k == 8
    assert rows[0].by_k[0] == pytest.approx((2.0 + 1.0) / 2)


def test_recovery_is_the_first_run_of_requests_back_at_speed_after_the_burst() -> None:
    # Baseline 100 tok/s; burst ends at 40 s. One fast request at 41 s is not a recovery.
    points = [(38.0, 50.0), (41.0, 99.0), (42.0, 60.0), (43.0, 70.0), (45.0, 96.0), (46.0, 94.0), (47.0, 97.0)]
    assert recovery_s(points, 40.0, 100.0) == pytest.approx(5.0)
    assert recovery_s(points, 40.0, 100.0, run=1) == pytest.approx(1.0)
    assert recovery_s(points[:5], 40.0, 100.0) is None
    assert recovery_s(points, 40.0, math.nan) is None


def test_burst_row_splits_the_requests_around_the_burst() -> None:
    def at(start_s: float, rate: float) -> RunRecord:
        return _run(None, rate, start_s=start_s, total_s=1.5)

    requests = [at(s, 100.0) for s in (0.0, 2.0, 4.0)] + [at(5.0, 60.0), at(20.0, 50.0)]  # 5.0 overlaps
    requests += [at(30.0 + 2 * i, 100.0) for i in range(12)]
    row = burst_row(BurstPass(None, 6.0, 29.0, requests))
    assert row.before.n == 3 and row.during.n == 2 and row.during.median == pytest.approx(55.0)
    assert row.recovery_s == pytest.approx(1.0) and row.met
    assert row.after.n == sum(30.0 + 2 * i >= 29.0 + TARGET_S for i in range(12))
    assert row.drafting[0] == pytest.approx(1.0)
    # Requests that failed right after the burst are not back at speed (two of three: the median is 0).
    failures = [FailedRequest(s, 0, None, "DEADLINE_EXCEEDED") for s in (30.5, 31.0)]
    failed = burst_row(BurstPass(None, 6.0, 29.0, requests, failures))
    assert failed.recovery_s == pytest.approx(2.0) and failed.failed == 2


def test_fixed_k_and_burst_reach_the_summary_the_page_and_the_json(tmp_path: Path) -> None:
    costs = ServiceCosts(target=[ForwardCost(1, 1, 0.05)], draft=[ForwardCost(1, 1, 0.01)],
                         default_num_speculative_tokens=8, max_speculative_tokens=8, adaptive_k=True)
    w1 = [_run(0, 20.0), _run(None, 40.0), _run(8, 41.0), _run(0, 18.0, temperature=0.8),
          _run(None, 30.0, temperature=0.8), _run(8, 15.0, temperature=0.8)]
    passes = [BurstPass(k, 20.0, 40.0, [_run(k, 50.0, start_s=float(s), total_s=1.0) for s in range(0, 70, 2)],
                        [FailedRequest(21.0, 0, k, "DEADLINE_EXCEEDED")]) for k in (None, 0)]
    results = BenchResults({"config": {"temperature": 0.8}}, costs, w1,
                           burst=BurstRun({"burst_s": 20.0}, passes))
    path = tmp_path / "bench.json"
    results.save(path)
    loaded = BenchResults.load(path)
    assert loaded.burst == results.burst
    summary = summarize(loaded)
    assert [(v.where, v.best_k) for v in summary.vs_fixed_k] == [("W1 greedy", 8), ("W1 T=0.8", 0)]
    assert summary.burst is not None and summary.burst.row("speculative") is not None
    table = summary_table(summary)
    assert "adaptive K ÷ best fixed K, W1 greedy (K=8; target ≥ 0.95×) | 0.976× (met)" in table
    assert "after a 20 s CPU burst (target ≤ 15 s) | 0.0 s (met)" in table
    plots = {name: tmp_path / f"{name}.png" for name in
             ("speedup_vs_k", "throughput_vs_concurrency", "acceptance_by_position", "round_anatomy")}
    page = render_page(loaded, summary, plots, tmp_path / "benchmarks.md", path)
    assert "## Adaptive K against fixed K" in page and "## A CPU burst" in page


def test_fixed_k_modes_and_their_checks() -> None:
    assert modes(dataclasses.replace(QUICK, fixed_k=(4, 8))) == (0, None, 4, 8)
    assert modes(QUICK) == (0, None)
    with pytest.raises(InvalidArgumentError):
        dataclasses.replace(QUICK, fixed_k=(0,))
    with pytest.raises(InvalidArgumentError):
        dataclasses.replace(QUICK, burst_s=-1.0)
