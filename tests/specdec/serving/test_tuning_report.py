"""A model service's start-up choices: one log line, the same list in `Info`, reused by a
restart with the same key and measured again when the key changes. The measurements are
pinned, so nothing here depends on the machine's speed or on a warm cache."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from specdec.cost_model import ForwardCost
from specdec.serving import model_service
from specdec.serving.model_service import build_engine
from specdec.target_server.config import TargetConfig
from specdec.target_server.engine import TargetEngine
from specdec.tuning import startup
from specdec.wire.model_info import ModelInfo

TABLE = [ForwardCost(1, 1, 0.02, context=48), ForwardCost(1, 2, 0.025, context=48)]


@pytest.fixture
def pinned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Measurements pinned and counted; the tuning cache in `tmp_path`."""
    measured: list[str] = []
    monkeypatch.setattr(startup, "default_cache_dir", lambda: tmp_path)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))

    def costs(forward: object, cache: object, *, max_batch: int, max_tokens: int) -> list[ForwardCost]:
        measured.append("forward_costs")
        return TABLE

    def dense(weight: object) -> tuple[str, str]:
        measured.append("dense_kernels")
        return "aten", "aten"

    monkeypatch.setattr(startup, "measure_forward_costs", costs)
    monkeypatch.setattr(startup, "measure_dense", dense)
    return measured


def _start(config: TargetConfig, caplog: pytest.LogCaptureFixture) -> tuple[ModelInfo, list[str]]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=model_service.__name__):
        engine = build_engine(TargetEngine, config)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up choices:")]
    return ModelInfo.from_pb(engine.info().to_pb()), lines


@pytest.mark.slow
def test_one_line_and_info_report_every_choice_and_a_restart_reuses_them(
    pinned: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    config = TargetConfig(kv_token_budget=1024, max_slots=2, max_speculative_tokens=2, retain_freed_memory=False,
                          compile="off")
    info, lines = _start(config, caplog)
    assert len(lines) == 1
    reasons = {c.name: c.reason for c in info.tuning}
    assert set(reasons) >= {"heap", "threads", "openmp_binding", "release_threads", "compile_cache", "dense_kernels",
                            "attention", "prefill_chunk_tokens", "compiled_steps", "forward_costs"}
    assert reasons["attention"] == "fixed" and reasons["prefill_chunk_tokens"] == "flag"
    assert reasons["forward_costs"] == "measured" and reasons["compiled_steps"] == "flag"  # --compile off
    assert reasons["heap"] == "flag" and reasons["compile_cache"] == "flag"  # TORCHINDUCTOR_CACHE_DIR set
    assert all(str(choice) in lines[0] for choice in info.tuning)
    assert info.forward_costs == tuple(TABLE)
    first = list(pinned)

    info, lines = _start(config, caplog)  # a restart with the same key: nothing measured
    assert pinned == first and len(lines) == 1
    assert {c.name: c.reason for c in info.tuning}["forward_costs"] == "cached" and info.forward_costs == tuple(TABLE)

    info, _ = _start(dataclasses.replace(config, max_slots=3), caplog)  # a changed key measures again
    assert pinned == first + first
    assert {c.name: c.reason for c in info.tuning}["forward_costs"] == "measured"

    info, _ = _start(dataclasses.replace(config, tuning_cache=False), caplog)  # the cache turned off
    assert {c.name: c.reason for c in info.tuning}["forward_costs"] == "measured"
