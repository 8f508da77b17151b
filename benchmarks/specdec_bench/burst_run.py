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

from specdec.client import SpecdecClient
from specdec_bench.burst import LEAD_S, TAIL_S, BurstPass, BurstRun
from specdec_bench.config import BenchConfig
from specdec_bench.sweeps import Progress
from specdec_bench.workloads import PROMPTS, RunRecord, run_request

#: Busy processes of a burst: one per core of the 2-core machines the harness runs on.
HOGS = 2
_SPIN = "while True: pass"


class CpuBurst:
    """In a thread: `lead_s` after `t0`, start `HOGS` busy processes; kill them `burst_s` later.
    `from_s` / `to_s`: when they ran, seconds after `t0`."""

    def __init__(self, t0: float, lead_s: float, burst_s: float) -> None:
        self.t0, self.lead_s, self.burst_s = t0, lead_s, burst_s
        self.from_s = self.to_s = float("nan")
        self._hogs: list[subprocess.Popen[bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-burst", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._stop.wait(max(self.t0 + self.lead_s - time.monotonic(), 0.0)):
            return
        self._hogs = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(HOGS)]
        self.from_s = time.monotonic() - self.t0
        self._stop.wait(self.burst_s)
        self._kill()

    def _kill(self) -> None:
        hogs, self._hogs = self._hogs, []
        for hog in hogs:
            hog.kill()
            hog.wait()
        if hogs:
            self.to_s = time.monotonic() - self.t0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._kill()


def burst_pass(client: SpecdecClient, config: BenchConfig, k: int | None, progress: Progress) -> BurstPass:
    """Greedy requests in mode `k`, the prompts cycled, through one burst."""
    span_s = LEAD_S + config.burst_s + TAIL_S
    requests: list[RunRecord] = []
    t0 = time.monotonic()
    burst = CpuBurst(t0, LEAD_S, config.burst_s)
    try:
        while (start_s := time.monotonic() - t0) < span_s:
            progress.set_description(f"burst, {'plain' if k == 0 else 'speculative'}: {start_s:.0f} s of {span_s:.0f}")
            record, _ = run_request(client, "burst", len(requests) % config.prompts, k,
                                    max_new_tokens=config.max_new_tokens, repetition=len(requests),
                                    prompts=PROMPTS)
            record.start_s = start_s
            requests.append(record)
    finally:
        burst.stop()
    return BurstPass(k, burst.from_s, burst.to_s, requests)


def measure_burst(client: SpecdecClient, config: BenchConfig, progress: Progress) -> BurstRun:
    """The speculative pass, then the plain one."""
    passes = [burst_pass(client, config, k, progress) for k in (None, 0)]
    meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "burst_s": config.burst_s,
            "lead_s": LEAD_S, "tail_s": TAIL_S, "hogs": HOGS, "max_new_tokens": config.max_new_tokens}
    return BurstRun(meta, passes)
