"""The benchmark harness's arithmetic and plumbing on synthetic records: no services, no models."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import pytest

from specdec.cost_model import ForwardCost, expected_speedup
from specdec_bench.analysis import (
    acceptance_by_position,
    all_rounds,
    method_rows,
    method_targets,
    pairwise_ratio,
    percentile,
    summarize,
)
from specdec_bench.config import QUICK, add_bench_flags, config_from_args
from specdec_bench.peers import PeerRecord
from specdec_bench.report import render_page
from specdec_bench.results import BenchResults, ServiceCosts
from specdec_bench.step_timing import StepPair
from specdec_bench.sweeps import ConcurrencyGroup, method_order
from specdec_bench.workloads import DraftMethod, RunRecord

FINAL_LINE = re.compile(r"^speedup=\d+\.\d{3} vs_hf_assisted=\d+\.\d{3} efficiency=\d+\.\d{3} "
                        r"alpha=\d+\.\d{3} c=\d+\.\d{3}$")


def _run(k: int | None, rate: float, *, phase: str = "w1", temperature: float = 0.0, **extra: Any) -> RunRecord:
    fields: dict[str, Any] = dict(
        phase=phase, prompt=0, k=k, temperature=temperature, repetition=0, tokens_per_s=rate,
        time_to_first_token_s=0.1, total_s=1.1, completion_tokens=11, num_rounds=0, num_draft_tokens=0,
        num_accepted_tokens=0,
        anatomy={"draft_compute": 0.2, "verify_compute": 0.7, "rpc": 0.05, "accept": 0.05, "other": 0.0},
    )
    return RunRecord(**{**fields, **extra})


def test_alpha_is_the_geometric_mle_and_positions_are_conditional() -> None:
    # K=2, 10 rounds: position 1 accepted 8 times, position 2 accepted 6 times (given 1).
    run = _run(2, 1.0, phase="k_sweep", num_drafts=10, accepted_per_pos=[8, 6])
    conditional, unconditional, alpha = acceptance_by_position([run], 2)
    assert conditional == pytest.approx([0.8, 0.75])
    assert unconditional == pytest.approx([0.8, 0.6])
    assert alpha == pytest.approx(14 / (14 + 4))  # 4 rounds rejected a token


def test_all_rounds_counts_the_gateways_rounds_or_estimates_them_for_old_results() -> None:
    # 11 tokens: the first from the prefill, then 3 drafting rounds and 2 plain ones.
    counted = _run(None, 1.0, num_rounds=3, num_plain_rounds=2, num_draft_tokens=12, num_accepted_tokens=9)
    assert all_rounds([counted]) == 5
    # Results recorded before the gateway counted plain rounds: one round per accepted + 1 tokens.
    old = _run(None, 1.0, num_rounds=3, num_draft_tokens=12, num_accepted_tokens=7)
    assert all_rounds([old]) == 11 - 1 - 7
    assert all_rounds([counted, old]) == 5 + 3


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 95) == pytest.approx(3.85)


def test_summary_final_line_page_and_json_round_trip(tmp_path: Path) -> None:
    costs = ServiceCosts(
        target=[ForwardCost(1, 1, 0.050), ForwardCost(1, 5, 0.070), ForwardCost(4, 1, 0.080), ForwardCost(4, 5, 0.200)],
        draft=[ForwardCost(1, 1, 0.010)], default_num_speculative_tokens=4, max_speculative_tokens=16, adaptive_k=True,
    )
    w1 = [_run(0, 10.0), _run(0, 12.0), _run(None, 15.0, num_rounds=4, num_draft_tokens=16, num_accepted_tokens=12),
          _run(None, 21.0), _run(0, 9.0, temperature=0.8), _run(None, 11.0, temperature=0.8)]
    sweep = [_run(0, 10.0, phase="k_sweep"),
             _run(4, 16.0, phase="k_sweep", num_rounds=4, num_draft_tokens=16, num_accepted_tokens=12, num_drafts=4,
                  accepted_per_pos=[4, 3, 3, 2])]
    peers = [PeerRecord("hf_plain", 0, 0, 11, 1.0, 0.1, 11.0, True),
             PeerRecord("hf_assisted", 0, 0, 11, 1.0, 0.1, 12.0, True)]
    groups = [ConcurrencyGroup(2, 0, 1.0, [_run(0, 10.0, concurrency=2)]),
              ConcurrencyGroup(2, None, 0.5, [_run(None, 20.0)])]
    results = BenchResults({"config": {"temperature": 0.8, "cost_batch": 4}}, costs, w1, peers, sweep, groups)
    path = tmp_path / "bench.json"
    results.save(path)
    summary = summarize(BenchResults.load(path))
    assert summary.greedy.speedup == pytest.approx(18.0 / 11.0)  # medians: (15+21)/2 over (10+12)/2
    assert summary.vs_hf_assisted == pytest.approx(18.0 / 12.0)
    assert summary.startup.c == pytest.approx(0.2)
    assert summary.startup.s_by_k[3] == pytest.approx((0.070 - 0.050) / (4 * 0.050))
    assert summary.alpha == pytest.approx(12 / (12 + 2))
    best = max(expected_speedup(summary.alpha, k, 0.2, summary.startup.s_by_k[k - 1]) for k in range(1, 5))
    assert summary.expected == pytest.approx(best)
    assert summary.concurrency[0].speedup == pytest.approx(2.0)
    assert FINAL_LINE.match(summary.final_line())
    plots = {name: tmp_path / f"{name}.png" for name in
             ("speedup_vs_k", "throughput_vs_concurrency", "acceptance_by_position", "round_anatomy")}
    page = render_page(results, summary, plots, tmp_path / "docs" / "benchmarks.md", path)
    assert "](../speedup_vs_k.png)" in page and summary.final_line() in page


def test_side_by_side_steps_set_the_headline_c_and_expected_speedup(tmp_path: Path) -> None:
    """With step pairs timed in turn, c is the median of their ratios (not the start-up c),
    S(K) uses it with the start-up s(K), and the pairs survive the JSON round trip."""
    costs = ServiceCosts(
        target=[ForwardCost(1, 1, 0.050), ForwardCost(1, 5, 0.070)], draft=[ForwardCost(1, 1, 0.010)],
        default_num_speculative_tokens=4, max_speculative_tokens=16, adaptive_k=True,
    )
    w1 = [_run(0, 10.0), _run(None, 15.0, num_rounds=4, num_draft_tokens=16, num_accepted_tokens=12)]
    # (one step, 5 steps) per service: step costs (draft, target) 6/20, 9/30 and 4/20 ms: c 0.3, 0.3, 0.2.
    pairs = [StepPair(0.010, 0.034, 0.030, 0.110), StepPair(0.012, 0.048, 0.035, 0.155),
             StepPair(0.011, 0.027, 0.025, 0.105, probe=1)]
    path = tmp_path / "bench.json"
    BenchResults({"config": {}}, costs, w1, step_pairs=pairs).save(path)
    summary = summarize(BenchResults.load(path))
    assert summary.side_by_side is not None and summary.headline_costs is summary.side_by_side
    assert summary.side_by_side.c == pytest.approx(0.3) and summary.startup.c == pytest.approx(0.2)
    assert summary.side_by_side.target_step_s == pytest.approx(0.020)
    s4 = summary.startup.s_by_k[3]
    assert summary.side_by_side.expected_by_k[3] == pytest.approx(expected_speedup(summary.alpha, 4, 0.3, s4))
    assert summary.expected == pytest.approx(max(summary.side_by_side.expected_by_k[:4] + [1.0]))
    assert summary.final_line().endswith("c=0.300")
    assert summary.efficiency == pytest.approx(summary.greedy.speedup / summary.expected)


def test_quick_preset_and_flag_overrides() -> None:
    parser = argparse.ArgumentParser()
    add_bench_flags(parser)
    config = config_from_args(parser.parse_args(["--quick", "--max-new-tokens", "64", "--concurrency", "1,2"]))
    assert config.quick and config.prompts == QUICK.prompts and config.results == QUICK.results
    assert config.max_new_tokens == 64 and config.concurrency == (1, 2)


def test_concurrency_sweep_repeats_every_level_with_the_modes_alternating(monkeypatch: pytest.MonkeyPatch) -> None:
    from specdec_bench import sweeps

    calls: list[tuple[int, int | None]] = []

    def fake_group(client: object, level: int, k: int | None, **_: object) -> ConcurrencyGroup:
        calls.append((level, k))
        return ConcurrencyGroup(level, k, 1.0, [])

    class Progress:
        def update(self, n: float | None = 1) -> bool | None:
            return None

        def set_description(self, desc: str | None = None, refresh: bool | None = True) -> None:
            pass

    monkeypatch.setattr(sweeps, "run_group", fake_group)
    config = dataclasses.replace(QUICK, concurrency=(1, 4), concurrency_repetitions=2)
    groups = sweeps.concurrency_sweep(None, config, Progress())  # type: ignore[arg-type]
    assert calls == [(1, 0), (1, None), (1, None), (1, 0), (4, 0), (4, None), (4, None), (4, 0)]
    assert [(g.concurrency, g.k) for g in groups] == calls


def _method_run(workload: str, method: str, prompt: int, rep: int, rate: float, **extra: Any) -> RunRecord:
    return _run(0 if method == "none" else None, rate, phase="methods", prompt=prompt, repetition=rep,
                method=method, workload=workload, **extra)


def test_method_ratios_are_pairwise_medians_and_targets_are_checked(tmp_path: Path) -> None:
    # Copy-heavy, two prompts: auto runs 4× and 2× plain (median 3×) and 1.25× / 1× the model draft.
    runs = [_method_run("copy-heavy", "none", 0, 0, 10.0), _method_run("copy-heavy", "model", 0, 0, 32.0),
            _method_run("copy-heavy", "auto", 0, 0, 40.0, num_draft_tokens=40, num_lookup_draft_tokens=30),
            _method_run("copy-heavy", "none", 1, 0, 20.0), _method_run("copy-heavy", "model", 1, 0, 40.0),
            _method_run("copy-heavy", "auto", 1, 0, 40.0, num_draft_tokens=20, num_lookup_draft_tokens=0),
            _method_run("chat", "none", 0, 0, 10.0)]  # a pair whose partner is missing counts for nothing
    assert pairwise_ratio(runs, "copy-heavy", "auto", "none") == pytest.approx(3.0)
    assert pairwise_ratio(runs, "copy-heavy", "auto", "model") == pytest.approx(1.125)
    assert math.isnan(pairwise_ratio(runs, "chat", "auto", "model"))
    auto = next(r for r in method_rows(runs) if (r.workload, r.method) == ("copy-heavy", "auto"))
    assert auto.lookup_share == pytest.approx(0.5) and auto.tokens_per_s.median == pytest.approx(40.0)
    checks = {(t.workload, t.method, t.baseline): t.met for t in method_targets(runs)}
    assert checks[("copy-heavy", "auto", "none")] and not checks[("copy-heavy", "auto", "model")]
    assert not checks[("chat", "auto", "model")]  # not measured: NaN is not met
    assert method_targets([]) == []
    costs = ServiceCosts(target=[ForwardCost(1, 1, 0.05)], draft=[ForwardCost(1, 1, 0.01)],
                         default_num_speculative_tokens=4, max_speculative_tokens=8, adaptive_k=True)
    path = tmp_path / "bench.json"
    BenchResults({"config": {}}, costs, [_run(0, 10.0), _run(None, 15.0)], methods=runs).save(path)
    loaded = BenchResults.load(path)
    assert loaded.methods == runs
    summary = summarize(loaded)
    plots = {name: tmp_path / f"{name}.png" for name in
             ("speedup_vs_k", "throughput_vs_concurrency", "acceptance_by_position", "round_anatomy")}
    page = render_page(loaded, summary, plots, tmp_path / "benchmarks.md", path)
    assert "## Drafting methods by workload" in page and "| copy-heavy: auto ÷ plain | ≥ 3× | 3.00× | met |" in page


def test_method_order_gives_each_method_each_place_in_turn() -> None:
    methods = tuple(DraftMethod)
    orders = [method_order(methods, turn) for turn in range(len(methods))]
    assert orders[0] == methods and orders[1][0] is methods[1]
    for place in range(len(methods)):
        assert {order[place] for order in orders} == set(methods)
