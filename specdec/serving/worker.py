"""A dedicated thread for model work, so the asyncio event loop never blocks on torch.

All engine calls of a service go through one worker thread: the engine and its KV cache
are touched by a single thread (no locks needed), while the event loop keeps answering
health checks, Info and cancellations.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class ModelWorker:
    """Runs callables one at a time on a single named thread."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def run_timed(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> tuple[T, float]:
        """`run`, plus the seconds `fn` itself took on the worker (queueing excluded)."""

        def timed() -> tuple[T, float]:
            started = time.perf_counter()
            result = fn(*args, **kwargs)
            return result, time.perf_counter() - started

        return await self.run(timed)

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
