"""Measure the noisy-neighbour burst (`specdec_bench.burst` has the records and figures).

Runs on the stack the rest of the run measured, after its other measurements: one pass of
speculative requests, then one of plain requests, each through its own burst. The burst is
`HOGS` busy Python processes at the services' priority, started and killed by this process.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import datetime, timezone

import grpc

from specdec.client import SpecdecClient
from specdec_bench.burst import LEAD_S, MIN_BEFORE, TAIL_S, BurstPass, BurstRun
from specdec_bench.config import BenchConfig
from specdec_bench.first_second import FailedRequest
from specdec_bench.first_second_run import MAX_FAILURES_IN_A_ROW
from specdec_bench.sweeps import Progress
from specdec_bench.workloads import PROMPTS, RunRecord, run_request

#: Busy processes of a burst: one per core of the 2-core machines the harness runs on.
HOGS = 2
_SPIN = "while True: pass"


class CpuBurst:
    """`HOGS` busy processes from now on, killed `burst_s` later by a thread (or by `stop`).
    `from_s` / `to_s`: when they ran, seconds after `t0`."""

    def __init__(self, t0: float, burst_s: float) -> None:
        self.t0 = t0
        self._hogs = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(HOGS)]
        self.from_s = time.monotonic() - t0
        self.to_s: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(burst_s,), name="cpu-burst", daemon=True)
        self._thread.start()

    def _run(self, burst_s: float) -> None:
        self._stop.wait(burst_s)
        with self._lock:
            hogs, self._hogs = self._hogs, []
            for hog in hogs:
                hog.kill()
                hog.wait()
            if hogs:
                self.to_s = time.monotonic() - self.t0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def burst_pass(client: SpecdecClient, config: BenchConfig, k: int | None, progress: Progress) -> BurstPass:
    """Greedy requests in mode `k`, the prompts cycled, through one burst."""
    requests: list[RunRecord] = []
    failures: list[FailedRequest] = []
    in_a_row = 0
    t0 = time.monotonic()
    burst: CpuBurst | None = None
    try:
        while burst is None or burst.to_s is None or time.monotonic() - t0 < burst.to_s + TAIL_S:
            start_s = time.monotonic() - t0
            if burst is None and start_s >= LEAD_S and len(requests) >= MIN_BEFORE:
                burst = CpuBurst(t0, config.burst_s)
            phase = "steady" if burst is None else "burst" if burst.to_s is None else "after"
            progress.set_description(f"burst, {'plain' if k == 0 else 'speculative'}: {phase}, {start_s:.0f} s")
            turn = len(requests) + len(failures)
            try:
                record, _ = run_request(client, "burst", turn % config.prompts, k,
                                        max_new_tokens=config.max_new_tokens, repetition=turn, prompts=PROMPTS)
            except (grpc.RpcError, RuntimeError) as error:
                failures.append(failed(error, start_s, turn % config.prompts, k))
                in_a_row += 1
                if in_a_row >= MAX_FAILURES_IN_A_ROW:
                    raise RuntimeError(f"the burst scenario failed {in_a_row} requests in a row") from error
                continue
            in_a_row = 0
            record.start_s = start_s
            requests.append(record)
    finally:
        if burst is not None:
            burst.stop()
    if burst is None or burst.to_s is None:
        raise RuntimeError("the burst did not run")
    return BurstPass(k, burst.from_s, burst.to_s, requests, failures)


def failed(error: Exception, start_s: float, prompt: int, k: int | None) -> FailedRequest:
    """A request that ended with an error: counted, not fatal (a service's deadline may pass on a
    crowded machine)."""
    code = error.code().name if isinstance(error, grpc.Call) else str(error)
    print(f"burst: a {'plain' if k == 0 else 'speculative'} request at {start_s:.0f} s failed: {code}",
          file=sys.stderr)
    return FailedRequest(start_s, prompt, k, code)


def measure_burst(client: SpecdecClient, config: BenchConfig, progress: Progress) -> BurstRun:
    """The speculative pass, then the plain one."""
    passes = [burst_pass(client, config, k, progress) for k in (None, 0)]
    meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "burst_s": config.burst_s,
            "lead_s": LEAD_S, "min_before": MIN_BEFORE, "tail_s": TAIL_S, "hogs": HOGS,
            "max_new_tokens": config.max_new_tokens}
    return BurstRun(meta, passes)
