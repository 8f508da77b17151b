"""The serial executor (a service's model worker): work and encoding run on its thread; compute
time is read on its clock, which waits for the device before it reads the time."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from specdec.serving.serial_executor import SerialExecutor
from specdec.tuning.timing import device_clock


def test_run_timed_times_the_work_alone_and_encodes_on_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    now = iter([10.0, 12.5])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))

    def clock() -> float:
        events.append("read")
        return next(now)

    def work() -> int:
        events.append(f"work on {threading.current_thread().name}")
        return 21

    def encode(result: int) -> str:
        events.append(f"encode on {threading.current_thread().name}")
        return str(2 * result)

    worker = SerialExecutor("test-worker", clock=device_clock("cuda", clock))
    try:
        encoded, seconds = asyncio.run(worker.run_timed(work, encode))
    finally:
        worker.shutdown()
    assert (encoded, seconds) == ("42", 2.5)
    # The launched work is waited for before the clock stops; the encoding is not timed.
    thread = events[2].removeprefix("work on ")
    assert thread.startswith("test-worker")
    assert events == ["sync", "read", f"work on {thread}", "sync", "read", f"encode on {thread}"]
