"""`StartupTuner`: a flag wins, a cached value is reused without measuring, a missing or bad one
is measured (with the measurement pinned here) and saved for the next start."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specdec.model.attention import GatherAttention, SdpaAttention
from specdec.tuning import startup
from specdec.tuning.startup import StartupTuner
from specdec.tuning.store import TuningKey, TuningStore

KEY = TuningKey(
    machine="cpu", torch="t", model="m", weights="w", dtype="bfloat16", quantization="int4", device="cpu", threads=2,
    code="c", settings="",
)


def _tuner(tmp_path: Path) -> StartupTuner:
    return StartupTuner(TuningStore(tmp_path), KEY)


def _pin_int4(monkeypatch: pytest.MonkeyPatch, times: dict[str, float]) -> list[int]:
    calls: list[int] = []

    def measure(dtype: torch.dtype) -> dict[str, float]:
        calls.append(1)
        return times

    monkeypatch.setattr(startup, "measure_int4_kernels", measure)
    return calls


def test_measured_then_cached_then_measured_again_when_the_file_is_bad(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _pin_int4(monkeypatch, {"dequant": 3.0, "int4pack": 1.0, "int4dot": 2.0})
    first = _tuner(tmp_path)
    assert first.int4_kernel("auto", "cpu", torch.bfloat16) == "int4pack"
    assert (first.choices[0].value, first.choices[0].reason) == ("int4pack", "measured")
    assert "int4pack 1000.00 ms" in first.choices[0].detail
    first.save()

    second = _tuner(tmp_path)
    assert second.int4_kernel("auto", "cpu", torch.bfloat16) == "int4pack"
    assert second.choices[0].reason == "cached" and len(calls) == 1 and not second.measured
    second.save()  # nothing measured: nothing written

    TuningStore(tmp_path).path(KEY).write_text("{broken")
    third = _tuner(tmp_path)
    third.int4_kernel("auto", "cpu", torch.bfloat16)
    assert third.choices[0].reason == "measured" and len(calls) == 2


def test_a_cached_value_that_is_no_longer_valid_is_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    TuningStore(tmp_path).save(KEY, {"int4_kernel": "fastest-ever"})
    calls = _pin_int4(monkeypatch, {"dequant": 1.0})
    tuner = _tuner(tmp_path)
    assert tuner.int4_kernel("auto", "cpu", torch.bfloat16) == "dequant" and len(calls) == 1


def test_flags_and_devices_decide_without_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _pin_int4(monkeypatch, {"dequant": 1.0})
    tuner = StartupTuner()  # no cache
    assert tuner.int4_kernel("int4pack", "cpu", torch.bfloat16) == ""
    assert tuner.int4_kernel("auto", "cuda:0", torch.bfloat16) == "dequant"
    assert [(c.value, c.reason) for c in tuner.choices] == [("int4pack", "flag"), ("dequant", "fixed")]
    assert calls == []
    tuner.save()  # no store: nothing to do


def test_the_cost_table_is_reused_only_when_nothing_else_was_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = [[1, 1, 0.01, 48], [1, 2, 0.012, 48]]
    TuningStore(tmp_path).save(KEY, {"int4_kernel": "dequant", "forward_costs": table})
    measured: list[int] = []

    def measure(forward: object, cache: object, *, max_batch: int, max_tokens: int) -> list[object]:
        measured.append(1)
        return []

    monkeypatch.setattr(startup, "measure_forward_costs", measure)
    monkeypatch.setattr(startup, "step_seconds", lambda forward, cache: 0.011)  # as fast as the table says
    monkeypatch.setattr(startup, "compiled_step_names", lambda forward: ())
    tuner = _tuner(tmp_path)
    costs = tuner.forward_costs(object(), object(), max_batch=4, max_tokens=9, enabled=True)  # type: ignore[arg-type]
    assert [(c.batch_size, c.tokens, c.seconds, c.context) for c in costs] == [(1, 1, 0.01, 48), (1, 2, 0.012, 48)]
    assert tuner.choices[-1].reason == "cached" and measured == []
    assert tuner.choices[-1].detail == "1-token step 10.0 ms"

    tuner = _tuner(tmp_path)
    tuner.measured = True  # e.g. a kernel was measured anew: its forward may cost something else now
    assert tuner.forward_costs(object(), object(), max_batch=4, max_tokens=9, enabled=True) == ()  # type: ignore[arg-type]
    assert tuner.choices[-1].reason == "measured" and measured == [1]

    off = _tuner(tmp_path)
    assert off.forward_costs(object(), object(), max_batch=4, max_tokens=9, enabled=False) == ()  # type: ignore[arg-type]
    assert (off.choices[-1].value, off.choices[-1].reason) == ("not measured", "flag")


def test_the_attention_kernel_is_the_devices_default_unless_a_flag_names_one() -> None:
    forward = SimpleNamespace(embed_tokens=SimpleNamespace(weight=torch.zeros(1)), attention=None)
    tuner = StartupTuner()
    tuner.attention(forward, "auto")  # type: ignore[arg-type]
    assert isinstance(forward.attention, SdpaAttention)
    tuner.attention(forward, "gather")  # type: ignore[arg-type]
    assert isinstance(forward.attention, GatherAttention)
    assert [(c.name, c.value, c.reason) for c in tuner.choices] == [
        ("attention", "sdpa", "fixed"), ("attention", "gather", "flag"),
    ]
    assert tuner.choices[0].detail == "the default on cpu"


def test_a_cached_cost_table_timed_on_a_busier_machine_is_timed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specdec.cost_model import ForwardCost

    TuningStore(tmp_path).save(KEY, {"forward_costs": [[1, 1, 0.2, 48], [1, 1, 0.3, 304]]})
    monkeypatch.setattr(startup, "measure_forward_costs",
                        lambda forward, cache, *, max_batch, max_tokens: [ForwardCost(1, 1, 0.02, 48)])
    monkeypatch.setattr(startup, "compiled_step_names", lambda forward: ("batch 1-token steps",))
    now = {"step": 0.19}  # within STALE_TABLE_FACTOR of the table: kept
    monkeypatch.setattr(startup, "step_seconds", lambda forward, cache: now["step"])
    tuner = _tuner(tmp_path)
    costs = tuner.forward_costs(object(), object(), max_batch=4, max_tokens=9, enabled=True)  # type: ignore[arg-type]
    assert costs[0].seconds == 0.2 and tuner.choices[-1].reason == "cached"

    now["step"] = 0.2 / startup.STALE_TABLE_FACTOR / 2  # the machine is twice faster than that: timed again
    tuner = _tuner(tmp_path)
    costs = tuner.forward_costs(object(), object(), max_batch=4, max_tokens=9, enabled=True)  # type: ignore[arg-type]
    assert [c.seconds for c in costs] == [0.02]
    assert tuner.choices[-1].reason == "measured"
    assert "cached table's 1-token step 200.0 ms, 66.7 ms now" in tuner.choices[-1].detail
    assert tuner.costs_steps == ("batch 1-token steps",)
    tuner.save()
    assert TuningStore(tmp_path).load(KEY)["forward_costs_steps"] == ["batch 1-token steps"]


def test_a_table_timed_before_the_compiled_steps_loaded_is_outdated_once_they_have(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specdec.cost_model import ForwardCost

    steps: dict[str, tuple[str, ...]] = {"names": ()}
    monkeypatch.setattr(startup, "compiled_step_names", lambda forward: steps["names"])
    monkeypatch.setattr(startup, "measure_forward_costs",
                        lambda forward, cache, *, max_batch, max_tokens: [ForwardCost(1, 1, 0.08, 48)])

    def timed_again(forward: object, cache: object, *, max_batch: int, max_tokens: int):  # type: ignore[no-untyped-def]
        yield
        return [ForwardCost(1, 1, 0.02, 48)]

    monkeypatch.setattr(startup, "forward_cost_steps", timed_again)
    tuner = _tuner(tmp_path)
    tuner.forward_costs(object(), object(), max_batch=4, max_tokens=9, enabled=True)  # type: ignore[arg-type]
    assert not tuner.costs_outdated(object())  # type: ignore[arg-type]
    steps["names"] = ("batch 1-token steps",)  # the deferred graphs loaded
    assert tuner.costs_outdated(object())  # type: ignore[arg-type]

    remeasure = tuner.remeasure_costs(object(), object(), max_batch=4, max_tokens=9)  # type: ignore[arg-type]
    next(remeasure)
    with pytest.raises(StopIteration) as ended:
        next(remeasure)
    assert [c.seconds for c in ended.value.value] == [0.02]
    assert not tuner.costs_outdated(object())  # type: ignore[arg-type]
    saved = TuningStore(tmp_path).load(KEY)
    assert saved["forward_costs"] == [[1, 1, 0.02, 48]] and saved["forward_costs_steps"] == ["batch 1-token steps"]
