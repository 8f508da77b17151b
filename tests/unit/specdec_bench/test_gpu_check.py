"""`make gpu-check`'s own logic, in seconds: stages time-boxed in their own processes (fake stages),
the figures kept from a stage killed mid-way, the summary line, the step timing on a tiny model,
and the carry's size limit. The whole check runs on a CPU with `--small` (docs/gpu.md)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import pytest

from specdec.model.llama import PagedLlama
from specdec_bench.gpu.carry import check_size, folder_bytes
from specdec_bench.gpu.check import StagePlan, StageResult, StageStatus, chosen_stages, run_stages, time_boxes
from specdec_bench.gpu.config import GPU, SMALL, GpuCheckConfig, Stage
from specdec_bench.gpu.services import GreedyComparison, round_ms_per_token
from specdec_bench.gpu.stages import _pytest_counts
from specdec_bench.gpu.steps import nominal_bandwidth, time_steps, weight_bytes
from specdec_bench.gpu.summary import summary_line
from specdec_bench.workloads import RunRecord
from tests.support.tiny_models import tiny_llama


def _fake_stage(tmp_path: Path, stage: Stage, body: str, time_box_s: float) -> StagePlan:
    """A stage whose process runs `body` (Python) with `record` the path of its figures file."""
    record = tmp_path / f"{stage.value}.json"
    code = f"import json, sys, time\nrecord = {str(record)!r}\n{body}"
    return StagePlan(stage, [sys.executable, "-c", code], record, time_box_s)


def test_stages_run_time_boxed_and_one_failing_or_hanging_stops_none(tmp_path: Path) -> None:
    write = "open(record, 'w').write(json.dumps({figures}))"
    plans = [
        _fake_stage(tmp_path, Stage.STEP_SPEED, "import subprocess\n"  # a service it started, still running
                    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                    + write.format(figures="{'child': child.pid}") + "\ntime.sleep(60)", 1),
        _fake_stage(tmp_path, Stage.PREFLIGHT, write.format(figures={"device": {"name": "fake"}}), 4),
        _fake_stage(tmp_path, Stage.DEVICE_TESTS, write.format(figures={"error": "boom"}) + "\nsys.exit(1)", 4),
        _fake_stage(tmp_path, Stage.SERVICE_DEFAULTS, "sys.exit(3)", 20),
    ]
    started = time.monotonic()
    with (tmp_path / "check.log").open("a") as log:
        results = run_stages(plans, log)
    assert time.monotonic() - started < 40  # the sleeper was stopped, not waited for
    assert [r.status for r in results] == [StageStatus.TIMED_OUT, StageStatus.OK, StageStatus.FAILED,
                                           StageStatus.FAILED]
    assert "time box" in results[0].error
    assert not _running(results[0].figures["child"])  # stopped with the stage that started it
    assert results[1].figures == {"device": {"name": "fake"}}
    assert results[2].error == "boom" and results[2].figures == {}
    assert results[3].error == "exited with code 3"
    # The time the two quick stages left unused went to the last one.
    assert results[3].time_box_s > 22


def test_a_rerun_of_some_stages_runs_the_preflight_first_and_shares_the_whole_checks_time() -> None:
    assert chosen_stages("") == list(Stage)
    stages = chosen_stages("service_defaults, greedy_exact")
    assert stages == [Stage.PREFLIGHT, Stage.GREEDY_EXACT, Stage.SERVICE_DEFAULTS]
    boxes, own = time_boxes(GPU, stages), GPU.time_box_s
    assert sum(boxes.values()) == pytest.approx(sum(own.values()))
    assert boxes[Stage.SERVICE_DEFAULTS] / boxes[Stage.GREEDY_EXACT] == pytest.approx(
        own[Stage.SERVICE_DEFAULTS] / own[Stage.GREEDY_EXACT])
    assert time_boxes(GPU, list(Stage)) == own
    with pytest.raises(ValueError):
        chosen_stages("greedy")


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is no zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _result(stage: Stage, figures: dict[str, object], status: StageStatus = StageStatus.OK) -> StageResult:
    return StageResult(stage, status, 1.0, 10.0, figures=figures)


def test_the_summary_line_names_the_device_the_headline_figures_and_what_failed() -> None:
    results = [
        _result(Stage.PREFLIGHT, {"device": {"name": "NVIDIA H100 80GB HBM3"}}),
        _result(Stage.DEVICE_TESTS, {"counts": {"passed": 40, "skipped": 2}}),
        _result(Stage.GREEDY_PARITY, {"greedy": {"mismatch_rate": 0.025, "tokens": 256},
                                      "sampled": {"finish_reason": "length"}}),
        _result(Stage.STEP_SPEED, {"steps": [
            {"batch": 1, "step_s": 0.0024, "step_roofline_fraction": 0.79, "verify_over_step": 1.07},
            {"batch": 8, "step_s": 0.0030, "step_roofline_fraction": 0.6, "verify_over_step": 1.9}]}),
        _result(Stage.STACK_SPEED, {"steps": "half-written"}),
        dataclasses.replace(_result(Stage.GREEDY_EXACT, {}, StageStatus.TIMED_OUT), error="stopped"),
    ]
    line = summary_line(GPU, results)
    assert "\n" not in line
    assert line.startswith("gpu-check NVIDIA H100 80GB HBM3: 5/6 stages ok")
    assert "tests 40 passed 2 skipped" in line and "bfloat16 spec!=plain 2.5% of 256 tokens, sampled ok" in line
    assert "step b1 2.40 ms (79% of roofline), verify/step 1.07/1.90 at b1/8" in line
    assert "not ok: greedy_exact timed_out (stopped)" in line


def test_greedy_comparison_counts_differing_positions_and_missing_ones() -> None:
    comparison = GreedyComparison(k=4)
    comparison.add([1, 2, 3, 4], [1, 2, 3, 4], draft_tokens=8, accepted_tokens=6)
    comparison.add([1, 2, 3, 4], [1, 9, 3], draft_tokens=8, accepted_tokens=2)
    assert (comparison.prompts, comparison.tokens, comparison.mismatched_tokens) == (2, 8, 2)
    assert comparison.first_divergence == [None, 1] and comparison.first_mismatch() == 1
    assert comparison.mismatch_rate == 0.25 and comparison.acceptance_rate == 0.5


def test_round_time_per_token_by_phase() -> None:
    def run(prompt: int, k: int, tokens: int, draft_s: float, verify_s: float) -> RunRecord:
        return RunRecord("fixed_k", prompt, k, 0.0, 0, 0.0, 0.0, 0.0, tokens, 0, 0, 0,
                         {"draft_compute": draft_s, "verify_compute": verify_s, "rpc": 0.5})

    runs = [run(1, 0, 8, 0.0, 0.4), run(1, 4, 10, 0.2, 0.3), run(2, 4, 30, 0.6, 0.5)]
    table = round_ms_per_token(runs)
    assert list(table) == ["K=0", "K=4"]
    assert table["K=4"]["draft_compute"] == pytest.approx(1e3 * 0.8 / 40)
    assert table["K=4"]["verify_compute"] == pytest.approx(1e3 * 0.8 / 40)
    assert table["K=4"]["rpc"] == pytest.approx(1e3 * 1.0 / 40)
    assert table["K=0"]["verify_compute"] == pytest.approx(50.0) and table["K=0"]["accept"] == 0.0


def test_in_process_step_timing_covers_every_batch_and_width() -> None:
    model = tiny_llama()
    for graphs in (False, True):  # off CUDA the graphs' padded steps run eagerly
        timings = time_steps(PagedLlama(model), batches=(1, 3), widths=(1, 4), context=20, warmup=0, repeats=1,
                             graphs=graphs)
        assert {(t.batch, t.tokens) for t in timings} == {(1, 1), (1, 4), (3, 1), (3, 4)}
        assert all(t.seconds > 0 for t in timings)
    tied = model.model.embed_tokens.weight
    assert weight_bytes(model) == sum(p.numel() for p in model.parameters()) * 4
    assert model.lm_head.weight is tied  # counted once


def test_nominal_bandwidth_by_device_name() -> None:
    assert nominal_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert nominal_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert nominal_bandwidth("NVIDIA H200") == 4.8e12
    assert nominal_bandwidth("NVIDIA A10G") is None


def test_config_survives_its_json_and_the_gpu_boxes_fit_eight_minutes() -> None:
    for config in (GPU, SMALL):
        assert GpuCheckConfig.from_json(json.loads(json.dumps(config.to_json()))) == config
    assert set(GPU.time_box_s) == set(Stage) and sum(GPU.time_box_s.values()) <= 8 * 60 - 20
    assert dataclasses.replace(GPU, device="cpu").device == "cpu"


def test_pytest_counts_from_its_last_line() -> None:
    assert _pytest_counts("....\n12 passed, 1 skipped, 3 deselected in 4.20s\n") == {
        "passed": 12, "skipped": 1, "deselected": 3}
    assert _pytest_counts("x\n5 tests collected in 0.5s") == {"collected": 5, "selected": 5}
    assert _pytest_counts("138/706 tests collected (568 deselected) in 9.1s") == {
        "collected": 706, "selected": 138, "deselected": 568}
    assert _pytest_counts("no tests collected (7 deselected) in 1.0s") == {"deselected": 7}


def test_the_carry_refuses_to_grow_past_its_limit(tmp_path: Path) -> None:
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "a.whl").write_bytes(b"x" * 1000)
    (tmp_path / "manifest.json").write_text("{}")
    assert folder_bytes(tmp_path) == 1002
    assert check_size(tmp_path, limit=2000) == 1002
    with pytest.raises(SystemExit, match="over its"):
        check_size(tmp_path, limit=1000)
