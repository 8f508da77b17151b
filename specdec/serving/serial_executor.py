"""A serial executor: one dedicated thread, so the asyncio event loop never blocks on torch.

All engine calls of a model service go through one such thread (its model worker): the
engine and its KV cache are touched by a single thread (no locks needed), while the event
loop keeps answering health checks, Info and cancellations. A call's results are also
encoded there (`run_timed`'s `encode`): the copy from the device to the host waits for the
forward, and the event loop only sends the finished message. The gateway runs its sampler
and its tokenizer on one each.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from specdec.tuning.timing import Clock

P = ParamSpec("P")
T = TypeVar("T")
R = TypeVar("R")


class SerialExecutor:
    """Runs callables one at a time, in order, on a single named thread.

    `clock` times `run_timed`'s work: for a model on an asynchronous device, one that waits
    for the device first (`specdec.tuning.timing.device_clock`), so that compute times count
    the forward itself and not only its launch.
    """

    def __init__(self, name: str, clock: Clock = time.perf_counter) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._clock = clock
        #: When the last `run_timed` call (a client's request) ended, `time.monotonic` (None: none
        #: yet); not on `clock`, which on a GPU waits for the device and would block the event loop.
        self.last_timed_at: float | None = None

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def submit(self, fn: Callable[[], object]) -> None:
        """Queue `fn` without waiting for it (start-up work the thread's callers need later)."""
        self._executor.submit(fn)

    async def run_timed(self, work: Callable[[], T], encode: Callable[[T], R]) -> tuple[R, float]:
        """Run `work`, then `encode` its result, both on the worker; return what `encode` made
        and the seconds `work` took there on the worker's clock (queueing and encoding
        excluded)."""

        def timed() -> tuple[R, float]:
            started = self._clock()
            result = work()
            seconds = self._clock() - started
            self.last_timed_at = time.monotonic()
            return encode(result), seconds

        return await self.run(timed)

    def idle_for(self) -> float:
        """Seconds since the last `run_timed` call ended (infinite before any)."""
        return float("inf") if self.last_timed_at is None else time.monotonic() - self.last_timed_at

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


async def cancel_and_wait(task: asyncio.Task[None] | None) -> None:
    """Cancel a background task (if started) and wait until it has finished unwinding."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
