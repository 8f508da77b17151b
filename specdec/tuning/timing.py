"""The one timing helper of start-up choices: seconds of interleaved repeats.

Candidates are timed in turns (a, b, c, a, b, c, ...), not one after the other, so a change
in the machine's speed (another process, a frequency step) lands on all of them alike. Each
candidate reports the median of its samples, which drops the stalls, or for a kernel
microbenchmark the minimum (its noise only ever adds time, and close kernels rank by it). On
an asynchronous device the clock is read only after the device has finished (`synchronizer`):
every timing of device work in specdec goes through it, here or through `device_clock`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Generator, Hashable, Mapping
from typing import TypeVar

import torch

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
Clock = Callable[[], float]


def synchronizer(device: torch.device | str) -> Callable[[], None]:
    """What waits for `device` to finish its queued work: `torch.cuda.synchronize` on CUDA,
    nothing on the CPU (whose ops return when done)."""
    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def device_clock(device: torch.device | str, clock: Clock = time.perf_counter) -> Clock:
    """`clock`, read only once `device` has finished its queued work: on CUDA a kernel
    launch returns before the kernel ran, so an unsynchronized reading counts the launches,
    not the work. Free on the CPU."""
    sync = synchronizer(device)

    def read() -> float:
        sync()
        return clock()

    return read


def interleaved_times(
    candidates: Mapping[K, Callable[[], object]],
    *,
    repeats: int,
    warmup: int = 1,
    setup: Callable[[K], None] | None = None,
    sync: Callable[[], None] = lambda: None,
    clock: Clock = time.perf_counter,
    statistic: Callable[[list[float]], float] = statistics.median,
) -> dict[K, float]:
    """Seconds of one call of each candidate over `repeats` interleaved rounds (their median, or
    `statistic`), after `warmup` untimed rounds (first-call allocation, packing, thread start).
    `setup(key)` runs untimed before each call (e.g. to roll a KV slot back)."""
    samples = run_to_end(interleaved_samples(candidates, repeats=repeats, warmup=warmup, setup=setup, sync=sync,
                                             clock=clock))
    return {key: statistic(values) for key, values in samples.items()}


def interleaved_samples(
    candidates: Mapping[K, Callable[[], object]],
    *,
    repeats: int,
    warmup: int = 1,
    setup: Callable[[K], None] | None = None,
    sync: Callable[[], None] = lambda: None,
    clock: Clock = time.perf_counter,
) -> Generator[None, None, dict[K, list[float]]]:
    """`interleaved_times` one call at a time: yields after each call and returns every
    candidate's timed samples, so a serving process can take its turns between requests."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    samples: dict[K, list[float]] = {key: [] for key in candidates}
    for timed_round in range(warmup + repeats):
        for key, fn in candidates.items():
            if setup is not None:
                setup(key)
            sync()
            started = clock()
            fn()
            sync()
            if timed_round >= warmup:
                samples[key].append(clock() - started)
            yield
    return samples


def run_to_end(steps: Generator[None, None, T]) -> T:
    """Run a generator of steps (as `interleaved_samples`) to its end; returns its value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
