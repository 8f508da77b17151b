"""The one timing helper: medians (or minima) of interleaved rounds, setup untimed, the device waited for."""

from __future__ import annotations

import pytest
import torch

from specdec.tuning.timing import device_clock, interleaved_times, synchronizer


class FakeClock:
    """A clock that each candidate call advances by that candidate's next pinned duration."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_medians_of_interleaved_rounds_with_setup_and_warmup_untimed() -> None:
    clock = FakeClock()
    calls: list[str] = []
    durations = {"a": iter([100.0, 1.0, 9.0, 2.0]), "b": iter([100.0, 5.0, 4.0, 6.0])}  # first round: warm-up

    def candidate(name: str) -> object:
        def run() -> None:
            calls.append(name)
            clock.now += next(durations[name])
        return run

    def setup(name: str) -> None:
        calls.append(f"setup {name}")
        clock.now += 1000.0  # not timed

    times = interleaved_times({"a": candidate("a"), "b": candidate("b")}, repeats=3, setup=setup, clock=clock)
    assert times == {"a": 2.0, "b": 5.0}  # the warm-up round's 100 and the setups' 1000 left out
    assert calls[:4] == ["setup a", "a", "setup b", "b"]  # interleaved, a then b, every round
    assert calls.count("a") == calls.count("b") == 4


def test_a_microbenchmark_can_keep_each_candidates_minimum() -> None:
    clock = FakeClock()
    durations = {"a": iter([100.0, 1.0, 9.0, 8.0]), "b": iter([100.0, 5.0, 4.0, 6.0])}

    def candidate(name: str) -> object:
        def run() -> None:
            clock.now += next(durations[name])
        return run

    times = interleaved_times({"a": candidate("a"), "b": candidate("b")}, repeats=3, clock=clock, statistic=min)
    assert times == {"a": 1.0, "b": 4.0}  # by their medians b (5) would beat a (8)


def test_the_device_is_waited_for_before_and_after_each_call() -> None:
    events: list[str] = []
    interleaved_times({"x": lambda: events.append("call")}, repeats=1, warmup=0, sync=lambda: events.append("sync"),
                 clock=lambda: 0.0)
    assert events == ["sync", "call", "sync"]
    with pytest.raises(ValueError, match="repeats"):
        interleaved_times({"x": lambda: None}, repeats=0)


def test_synchronizer_waits_for_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    waited: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    synchronizer("cpu")()
    assert waited == []
    synchronizer("cuda:0")()
    assert waited == [torch.device("cuda:0")]


def test_a_device_clock_reads_the_time_only_after_the_device_finished(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(f"sync {device}"))

    def clock() -> float:
        events.append("read")
        return 1.5

    assert device_clock("cuda:0", clock)() == 1.5
    assert events == ["sync cuda:0", "read"]
    events.clear()
    device_clock("cpu", clock)()
    assert events == ["read"]
