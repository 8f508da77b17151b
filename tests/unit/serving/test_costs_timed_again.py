"""A service times its forward cost table again once its compiled steps have loaded: one forward
per worker call, only while no request came for a while, and publishes the new table."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator
from types import SimpleNamespace

from specdec.cost_model import ForwardCost
from specdec.serving import model_service
from specdec.serving.serial_executor import SerialExecutor


def _engine(steps: list[str], fail: bool = False) -> SimpleNamespace:
    def remeasure(forward: object, cache: object, *, max_batch: int, max_tokens: int
                  ) -> Generator[None, None, tuple[ForwardCost, ...]]:
        for i in range(3):
            steps.append(f"forward {i}")
            if fail and i == 1:
                raise RuntimeError("no room in the pool")
            yield
        return (ForwardCost(1, 1, 0.02),)

    config = SimpleNamespace(max_slots=4, max_speculative_tokens=8)
    return SimpleNamespace(config=config, forward_costs=(ForwardCost(1, 1, 0.08),), model=None, cache=None,
                           tuner=SimpleNamespace(remeasure_costs=remeasure))


def test_the_table_is_timed_again_between_requests_and_published(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(model_service, "IDLE_BEFORE_TIMING_S", 0.05)
    steps: list[str] = []
    engine, worker = _engine(steps), SerialExecutor("test")

    async def run() -> None:
        worker.last_timed_at = time.monotonic() + 0.1  # a request is still running
        task = asyncio.create_task(model_service.time_costs_again(engine, worker))  # type: ignore[arg-type]
        await asyncio.sleep(0.08)
        assert steps == []  # nothing timed beside it
        await task

    asyncio.run(run())
    worker.shutdown()
    assert steps == ["forward 0", "forward 1", "forward 2"]
    assert engine.forward_costs == (ForwardCost(1, 1, 0.02),)


def test_a_table_that_cannot_be_timed_again_stays(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(model_service, "IDLE_BEFORE_TIMING_S", 0.0)
    steps: list[str] = []
    engine, worker = _engine(steps, fail=True), SerialExecutor("test")
    asyncio.run(model_service.time_costs_again(engine, worker))  # type: ignore[arg-type]
    worker.shutdown()
    assert steps == ["forward 0", "forward 1"]
    assert engine.forward_costs == (ForwardCost(1, 1, 0.08),)


def test_deferred_graphs_load_only_after_a_pause_in_requests(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Each graph takes seconds and a request would wait behind it: none loads within
    `IDLE_BEFORE_LOADING_S` of start-up or of the last request."""
    monkeypatch.setattr(model_service, "IDLE_BEFORE_LOADING_S", 0.2)
    loaded: list[str] = []
    pending = ["single", "batch"]

    def load_pending(cache: object) -> bool:
        loaded.append(pending.pop(0))
        return bool(pending)

    tuner = SimpleNamespace(pending=pending, load_pending=load_pending, compiled_steps=lambda model: (),
                            loaded_detail=[], costs_outdated=lambda model: False)
    cache = SimpleNamespace(blocks=SimpleNamespace(free_tokens=100), capacity_tokens=100)
    engine, worker = SimpleNamespace(tuner=tuner, cache=cache, model=None), SerialExecutor("test")

    async def run() -> None:
        task = asyncio.create_task(model_service.load_graphs_after_start(engine, worker))  # type: ignore[arg-type]
        await asyncio.sleep(0.1)
        assert loaded == []  # too soon after start-up
        worker.last_timed_at = time.monotonic() + 0.2  # requests keep coming for a while
        await asyncio.sleep(0.3)
        assert loaded == []
        await asyncio.wait_for(task, 10)

    asyncio.run(run())
    worker.shutdown()
    assert loaded == ["single", "batch"]
