"""The call merger's orchestration with a fake engine: which calls run together, when a run is
held for another gateway's call, and that one call's error stays its own. What a run takes on
the worker is pinned (`PinnedClock`), and every wait a test relies on is far from its bound,
so no outcome depends on the machine's speed; the real services merge in
tests/gateway/test_shared_admission.py."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import pytest

from specdec.serving.call_merger import Answer, CallMerger, split, stamped
from specdec.serving.metrics import ServiceStats
from specdec.serving.serial_executor import SerialExecutor
from specdec.v1 import target_pb2


@dataclass(frozen=True)
class Call:
    name: str
    holder: str | None
    key: int = 0
    bad: bool = False
    rows: int = 1
    tokens: int = 1


class PinnedClock:
    """The worker's clock: every run appears to take `cost_s`."""

    def __init__(self, cost_s: float) -> None:
        self.cost_s, self.ticks = cost_s, 0

    def __call__(self) -> float:
        self.ticks += 1
        return self.ticks // 2 * self.cost_s


class Engine:
    """Records each engine call's calls; `gate` (when set up) stalls the next call until opened."""

    def __init__(self) -> None:
        self.runs: list[list[str]] = []
        self.gate: threading.Event | None = None
        self.running = threading.Event()

    def compute(self, calls: Sequence[Call]) -> list[str]:
        self.running.set()
        if self.gate is not None:
            gate, self.gate = self.gate, None
            assert gate.wait(timeout=30)
        self.runs.append([call.name for call in calls])
        if any(call.bad for call in calls):
            raise ValueError(f"bad input in {[c.name for c in calls if c.bad]}")
        return [call.name.upper() for call in calls]


@dataclass
class Setup:
    engine: Engine
    merger: CallMerger[Call, str, str]
    stats: ServiceStats
    holders: set[str]


def run(test: Callable[[Setup], Awaitable[None]], *, max_wait_s: float, holders: set[str] | None = None,
        first_backoff_s: float = 1.0) -> Setup:
    """Run `test` on a fresh event loop, with a merger whose runs all take 5 s on the worker's clock."""
    worker = SerialExecutor("test-merger", clock=PinnedClock(5.0))
    engine, stats = Engine(), ServiceStats("target", ["Verify"], ["Verify"])
    setup_holders = {"A", "B"} if holders is None else holders

    async def main() -> Setup:
        merger = CallMerger[Call, str, str]("Verify", worker, engine.compute, lambda call, out: out,
                                           lambda: setup_holders, stats, max_wait_s,
                                           first_backoff_s=first_backoff_s)
        setup = Setup(engine, merger, stats, setup_holders)
        await test(setup)
        return setup

    try:
        return asyncio.run(main())
    finally:
        worker.shutdown()


async def stalled_first(setup: Setup, call: Call) -> tuple[asyncio.Task[Answer[str]], threading.Event]:
    """Submit `call` with the engine stalled in it until the returned event is set."""
    gate = setup.engine.gate = threading.Event()
    first = asyncio.create_task(setup.merger.submit(call))
    while not setup.engine.running.is_set():
        await asyncio.sleep(0.001)
    return first, gate


async def settle() -> None:
    """Let the tasks created so far reach their first wait."""
    for _ in range(5):
        await asyncio.sleep(0)


def submit(setup: Setup, *calls: Call) -> list[asyncio.Task[Answer[str]]]:
    return [asyncio.create_task(setup.merger.submit(call)) for call in calls]


async def behind_stalled(setup: Setup, first: Call, *later: Call) -> list[Answer[str] | BaseException]:
    """`later` submitted while the engine is stalled in `first`, then the stall ends: every
    call's answer or error, `first`'s first."""
    task, gate = await stalled_first(setup, first)
    tasks = submit(setup, *later)
    await settle()
    gate.set()
    return await asyncio.gather(task, *tasks, return_exceptions=True)


def costs(answers: Sequence[Answer[str] | BaseException]) -> list[object]:
    """Each answer's response, compute seconds and run items (its queueing is wall time); errors as they are."""
    return [answer[:3] if isinstance(answer, Answer) else answer for answer in answers]


def test_calls_that_wait_for_the_worker_run_as_one() -> None:
    async def test(setup: Setup) -> None:
        answers = await behind_stalled(setup, Call("a", "A"), Call("b", "B", rows=2), Call("c", "C", rows=3))
        assert costs(answers) == [("A", 5.0, 1), ("B", 5.0, 5), ("C", 5.0, 5)]  # b, c: one run, its time and items

    setup = run(test, max_wait_s=0.0, holders={"A", "B", "C"})
    assert setup.engine.runs == [["a"], ["b", "c"]]
    assert setup.stats.merged_calls["Verify"] == 2
    assert setup.stats.batch_size["Verify"].count == 2  # one observation per run, not per call


def test_one_gateways_calls_together_are_not_counted_as_merged() -> None:
    async def test(setup: Setup) -> None:
        answers = await behind_stalled(setup, Call("a", "A"), Call("b", "B"), Call("c", "B"))
        assert costs(answers) == [("A", 5.0, 1), ("B", 5.0, 2), ("C", 5.0, 2)]

    setup = run(test, max_wait_s=0.0)
    assert setup.engine.runs == [["a"], ["b", "c"]]
    assert setup.stats.merged_calls["Verify"] == 0


def test_a_run_is_held_for_another_gateway_that_holds_slots_and_joins_it() -> None:
    async def test(setup: Setup) -> None:
        await setup.merger.submit(Call("b1", "B"))  # B is known here, and now drafting (no call here)
        [held] = submit(setup, Call("a", "A"))
        await asyncio.sleep(0.05)
        assert setup.engine.runs == [["b1"]], "a ran without waiting for B, which was due"
        [joined] = submit(setup, Call("b2", "B"))
        answers = [await held, await joined]
        assert costs(answers) == [("A", 5.0, 2), ("B2", 5.0, 2)]
        # One run began for both: a's answer counts the 0.05 s it was held before b2 came.
        assert answers[0].queued_s - answers[1].queued_s >= 0.04

    setup = run(test, max_wait_s=60.0)
    assert setup.engine.runs == [["b1"], ["a", "b2"]]
    assert setup.stats.merge_waits[("Verify", "joined")] == 1
    assert setup.stats.merge_waits[("Verify", "missed")] == 0
    assert setup.stats.merged_calls["Verify"] == 2


def test_a_missed_gateway_is_not_waited_for_during_its_back_off() -> None:
    async def test(setup: Setup) -> None:
        await setup.merger.submit(Call("b1", "B"))
        await setup.merger.submit(Call("a1", "A"))  # held for B for 0.1 s, then alone: B missed
        assert setup.stats.merge_waits[("Verify", "missed")] == 1
        await setup.merger.submit(Call("a2", "A"))  # not held
        await setup.merger.submit(Call("b2", "B"))  # held for A, which misses too
        await setup.merger.submit(Call("a3", "A"))  # B's own call did not end its back-off: not held

    setup = run(test, max_wait_s=0.1, first_backoff_s=60.0)
    assert setup.engine.runs == [["b1"], ["a1"], ["a2"], ["b2"], ["a3"]]
    assert setup.stats.merge_wait["Verify"].count == 2
    assert setup.stats.merge_waits[("Verify", "missed")] == 2


def test_a_missed_gateway_is_waited_for_again_after_its_back_off() -> None:
    async def test(setup: Setup) -> None:
        await setup.merger.submit(Call("b1", "B"))
        await setup.merger.submit(Call("a1", "A"))  # B missed: a back-off of 0.05 s
        await asyncio.sleep(0.1)
        [held] = submit(setup, Call("a2", "A"))
        await settle()
        [joined] = submit(setup, Call("b2", "B"))
        await asyncio.gather(held, joined)

    setup = run(test, max_wait_s=0.2, first_backoff_s=0.05)
    assert setup.engine.runs == [["b1"], ["a1"], ["a2", "b2"]]
    assert (setup.stats.merge_waits[("Verify", "missed")], setup.stats.merge_waits[("Verify", "joined")]) == (1, 1)


def test_no_hold_for_one_gateway_alone_a_gateway_without_slots_or_a_zero_wait() -> None:
    async def test(setup: Setup) -> None:
        await setup.merger.submit(Call("c1", "C"))  # C holds no slot here (its requests ended)
        for name in ("a1", "a2"):
            await setup.merger.submit(Call(name, "A"))  # A is alone with slots here
        setup.holders.add("C")
        setup.merger.max_wait_s = 0.0
        await setup.merger.submit(Call("a3", "A"))

    setup = run(test, max_wait_s=60.0, holders={"A"})
    assert setup.engine.runs == [["c1"], ["a1"], ["a2"], ["a3"]]
    assert setup.stats.merge_wait["Verify"].count == 0


def test_a_calls_bad_input_fails_that_call_alone() -> None:
    async def test(setup: Setup) -> None:
        _, good, bad = await behind_stalled(setup, Call("a", "A"), Call("b", "B"), Call("c", "C", bad=True))
        assert costs([good]) == [("B", 5.0, 1)]  # run again alone
        assert isinstance(bad, ValueError) and "['c']" in str(bad)

    setup = run(test, max_wait_s=0.0, holders={"A", "B", "C"})
    assert setup.engine.runs == [["a"], ["b", "c"], ["b"], ["c"]]


def test_calls_of_another_key_run_apart() -> None:
    async def test(setup: Setup) -> None:
        answers = await behind_stalled(setup, Call("a", "A"), Call("b", "B", key=1), Call("c", "C", key=2),
                                       Call("d", "D", key=1))
        assert costs(answers) == [("A", 5.0, 1), ("B", 5.0, 2), ("C", 5.0, 1), ("D", 5.0, 2)]

    setup = run(test, max_wait_s=0.0, holders={"A", "B", "C", "D"})
    assert setup.engine.runs == [["a"], ["b", "d"], ["c"]]


def test_a_call_cancelled_while_waiting_never_runs() -> None:
    async def test(setup: Setup) -> None:
        first, gate = await stalled_first(setup, Call("a", "A"))
        [gone] = submit(setup, Call("b", "B"))
        await settle()
        gone.cancel()
        await settle()
        gate.set()
        await first
        await setup.merger.submit(Call("c", "C"))

    setup = run(test, max_wait_s=0.0, holders={"A", "B", "C"})
    assert setup.engine.runs == [["a"], ["c"]]


def test_a_lone_call_whose_caller_goes_away_leaves_its_gateway_due_again() -> None:
    async def test(setup: Setup) -> None:
        first, gate = await stalled_first(setup, Call("a", "A"))  # alone: run in its caller's task
        first.cancel()
        await settle()
        gate.set()
        await setup.merger.submit(Call("b", "B"))  # A holds slots, nothing in flight: b is held for it

    setup = run(test, max_wait_s=0.1)
    assert setup.engine.runs == [["a"], ["b"]]
    assert setup.stats.merge_waits[("Verify", "missed")] == 1


def test_a_failure_in_the_merger_fails_the_waiting_calls_instead_of_leaving_them() -> None:
    def broken() -> set[str]:
        raise RuntimeError("lease table broken")

    async def test(setup: Setup) -> None:
        first, gate = await stalled_first(setup, Call("a", "A"))
        [waiting] = submit(setup, Call("b", "B"))
        await settle()
        setup.merger.holders = broken  # the runner that takes b on after a asks for the holders
        gate.set()
        await first
        with pytest.raises(RuntimeError, match="lease table broken"):
            await asyncio.wait_for(waiting, 30)

    run(test, max_wait_s=0.1)


def test_split_cuts_a_merged_answer_back_into_its_calls() -> None:
    assert split(["a", "b", "c"], [2, 0, 1]) == [["a", "b"], [], ["c"]]
    with pytest.raises(ValueError, match="3 outputs"):
        split(["a", "b", "c"], [2])


def test_stamped_writes_the_runs_costs_into_the_response() -> None:
    response = stamped(Answer(target_pb2.VerifyResponse(), compute_s=0.5, run_items=6, queued_s=0.25))
    assert (response.compute_s, response.run_items, response.queued_s) == (0.5, 6, 0.25)
