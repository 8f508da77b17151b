"""Hand the cores over: let a model service's idle OpenMP threads go instead of spinning
(small sync-heavy ops run on one thread with `specdec.tuning.threads.one_thread`).

Target and draft share the machine's cores and take turns. After a forward, libgomp's
worker threads spin for a while before they sleep (`GOMP_SPINCOUNT`, 300,000 pause
iterations by default: a few milliseconds), so the service that just answered still
holds a core when the other one starts, and each call is slower than when its service runs
alone. A shorter spin for the whole process is no cure: plain decoding loses as much as
speculation gains, since between two plain steps the target's spin bridges the gateway's turn
(docs/performance.md#openmp-threads-between-calls).

So a service lets its thread team go only after a call that hands the machine to the
other service: the draft after every Propose, the target after a Verify that judged
draft tokens. OpenMP 5.0's `omp_pause_resource_all` ends the calling thread's team, and
the next forward starts a new one (a fraction of a millisecond; where its workers start
is `specdec.tuning.thread_placement`'s business). It is a no-op where torch does not run on
libgomp.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

#: `omp_pause_soft` of OpenMP 5.0's `omp_pause_resource_t`: release the threads, keep the ICVs.
OMP_PAUSE_SOFT = 1
#: OpenMP's `omp_proc_bind_t`, by value.
PROC_BIND_POLICIES = ("false", "true", "primary", "close", "spread")


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch loaded (a library already loaded is found by its soname), or None."""
    try:
        return ctypes.CDLL("libgomp.so.1")
    except OSError:
        return None


@functools.cache
def _pause_all() -> Callable[[int], int] | None:
    """libgomp's `omp_pause_resource_all`, or None without one."""
    function = getattr(_libgomp(), "omp_pause_resource_all", None)
    if function is None:
        log.info("no libgomp with omp_pause_resource_all: OpenMP threads are left to spin")
        return None
    function.argtypes = [ctypes.c_int]
    function.restype = ctypes.c_int
    pause: Callable[[int], int] = function
    return pause


def proc_bind() -> str:
    """The calling thread's OpenMP thread-binding policy ("false" when unbound; "close" as
    `specdec.tuning.thread_placement` sets it), or "unknown" without libgomp."""
    function = getattr(_libgomp(), "omp_get_proc_bind", None)
    if function is None:
        return "unknown"
    function.restype = ctypes.c_int
    policy = function()
    return PROC_BIND_POLICIES[policy] if 0 <= policy < len(PROC_BIND_POLICIES) else str(policy)


def release_threads() -> bool:
    """End the calling thread's OpenMP team (its workers exit instead of spinning); the
    next parallel region starts a new one. Call it between forwards, from the thread that
    runs them. True when the runtime released them."""
    pause = _pause_all()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0
