"""A short soak (`specdec_bench.soak`): three service processes, mixed requests with client
cancellations, the draft killed (and restarted on its port) and stopped partway through.
Passes when nothing failed unexpectedly, every greedy output equals its solo run, both KV
pools are free again and no process grew (`python -m specdec_bench.soak` is the long run)."""

from __future__ import annotations

from specdec_bench.soak import SoakConfig, run_soak


def test_short_soak_with_cancellations_and_draft_faults() -> None:
    # Without the start-up cost tables (the planner then keeps each request's K), kernel
    # timings or compiled graphs (a cold cache compiles them for minutes, in the background
    # too): timing on 2 busy cores is slow, and the draft starts twice. One intra-op thread
    # each: beside the other test worker, a two-thread team waits at every barrier for a
    # thread the other processes hold off its core (several times slower on 2 cores).
    config = SoakConfig(
        requests=20, concurrency=8, prompts=3, stop_seconds=3.0,
        service_args=("--kv-token-budget 4096 --max-slots 32 --no-measure-costs --no-tune-kernels --compile off "
                      "--threads 1"),
    )
    report = run_soak(config, progress=False)
    assert report.ok, report.summary()
    assert report.cancelled > 0 and report.greedy_checked > 0  # the soak exercised what it claims
    assert any("SIGKILL" in event for event in report.events) and any("SIGSTOP" in event for event in report.events)
