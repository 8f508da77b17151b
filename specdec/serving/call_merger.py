"""Several gateways' work calls in one forward: a model service's call merger.

Gateways that share a target/draft pair each send their own Verify (or Propose) over their
own requests. Run one after another, each call is a forward costing nearly what one over
both batches would (a decoding forward streams the weights once, whatever its rows), so two
gateways would get little more than half the tokens one gets. A `CallMerger` runs the calls
of one kind that wait for the model worker as one engine call, and splits its answers back.

Calls rarely wait together on their own: two gateways settle into turns, one verifying while
the other drafts, and where the services share cores each turn is slowed by the other. So
before a run the merger holds what it has, for up to `max_wait_s`, while another gateway is
*due*: it owns slots here and has no call of this kind waiting or running (it is drafting, or
between rounds). Once merged, the gateways get their answers together and stay in step. A
gateway that does not come in time is *missed* and not waited for during a back-off (5 holds,
doubling to 150 at most, reset when it next comes in time), so one that holds slots here but
calls rarely (its requests decode without a draft) costs a wait now and then, not every run.
A service whose every holder calls every round backs off one hold only (the target's Verify).

One call's bad input must not fail the others: when a merged run raises, each call runs
again alone (the engines leave every slot as it was when a call fails) and gets its own
answer or error.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, Protocol, TypeVar

from specdec.serving.metrics import ServiceStats
from specdec.serving.serial_executor import SerialExecutor

log = logging.getLogger(__name__)

#: A missed gateway's back-off, in holds (`max_wait_s`): the first, doubled per miss up to the
#: longest. A gateway that never comes then costs a fifth of the time at first, under 1 % soon.
FIRST_BACKOFF_HOLDS, MAX_BACKOFF_HOLDS = 5, 150
#: Seconds without a merged run after which merging is logged as stopped.
QUIET_S = 10.0
#: While held, which gateways are due is looked at again this often (one may release its last slot).
POLL_S = 0.01


class WorkCall(Protocol):
    """What the merger needs of a call besides its payload."""

    @property
    def holder(self) -> str | None: ...  # the gateway whose slots it touches (None: no lease)

    @property
    def key(self) -> Hashable: ...  # calls merge only with calls of an equal key

    @property
    def rows(self) -> int: ...  # requests in the call

    @property
    def tokens(self) -> int: ...  # tokens it feeds and drafts, over its requests


C = TypeVar("C", bound=WorkCall)
Out = TypeVar("Out")  # what the engine answers one call
R = TypeVar("R")  # the response message of one call
T = TypeVar("T")


def split(outputs: Sequence[T], sizes: Sequence[int]) -> list[list[T]]:
    """`outputs` of a merged engine call, one per request, cut back into its calls' `sizes`."""
    if sum(sizes) != len(outputs):
        raise ValueError(f"{len(outputs)} outputs for calls of {list(sizes)} requests")
    return [list(outputs[end - size: end]) for size, end in zip(sizes, itertools.accumulate(sizes))]


class Answer(NamedTuple, Generic[R]):
    """A call's response, the compute seconds and items of the run it was part of, and the
    seconds it waited for that run to begin (held, or queued behind other work)."""

    response: R
    compute_s: float
    run_items: int
    queued_s: float = 0.0


class TimedResponse(Protocol):
    """A work call's response message: it tells the caller what its run cost."""

    compute_s: float
    run_items: int
    queued_s: float


TR = TypeVar("TR", bound=TimedResponse)


def stamped(answer: Answer[TR]) -> TR:
    """The answer's response, with its run's compute seconds and items and the call's
    queueing written in."""
    response = answer.response
    response.compute_s, response.run_items, response.queued_s = answer.compute_s, answer.run_items, answer.queued_s
    return response


@dataclass(eq=False)
class _Waiting(Generic[C, R]):
    call: C
    answer: asyncio.Future[Answer[R]]
    #: When it was submitted (`CallMerger.clock`).
    arrived: float


@dataclass
class _Holder:
    #: Its calls of this kind waiting or running.
    in_flight: int = 0
    #: Missed: not waited for before this instant (`clock`), nor while `in_flight`.
    skip_until: float = 0.0
    #: The back-off of its next miss (seconds; 0: none missed since it last came in time).
    backoff_s: float = 0.0

    def missed(self, now: float, first_s: float, max_s: float) -> None:
        self.backoff_s = min(max_s, 2 * self.backoff_s) if self.backoff_s else first_s
        self.skip_until = now + self.backoff_s


@dataclass
class CallMerger(Generic[C, Out, R]):
    """Runs one kind of work call (`method`) on `worker`, merged across gateways.

    `compute` runs on the worker: the calls' requests in one engine call, one output per
    call. `encode` (also on the worker, right after) turns a call and its output into its
    response. `holders` names the gateways that own slots here now.
    """

    method: str
    worker: SerialExecutor
    compute: Callable[[Sequence[C]], Sequence[Out]]
    encode: Callable[[C, Out], R]
    holders: Callable[[], set[str]]
    stats: ServiceStats
    max_wait_s: float
    clock: Callable[[], float] = time.monotonic
    #: Back-off of a first miss, and the longest (seconds; None: `FIRST_BACKOFF_HOLDS` and
    #: `MAX_BACKOFF_HOLDS` holds).
    first_backoff_s: float | None = None
    max_backoff_s: float | None = None
    _waiting: list[_Waiting[C, R]] = field(default_factory=list, init=False)
    _seen: dict[str, _Holder] = field(default_factory=dict, init=False)
    _arrived: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _runner: asyncio.Task[None] | None = field(default=None, init=False)
    #: A lone call runs in its caller's task (`_run_alone`).
    _alone: bool = field(default=False, init=False)
    #: When a run last merged two holders' calls (None: not lately).
    _merged_at: float | None = field(default=None, init=False)

    async def submit(self, call: C) -> Answer[R]:
        """Run `call` (merged with others where it can be); its response, and the compute
        seconds and items of the run it was part of."""
        waiting = _Waiting[C, R](call, asyncio.get_running_loop().create_future(), self.clock())
        if call.holder is not None:
            self._seen.setdefault(call.holder, _Holder()).in_flight += 1
        self._waiting.append(waiting)
        self._arrived.set()
        try:
            if not self._alone and not self._running():
                if len(self._waiting) == 1 and not self._due():
                    await self._run_alone(waiting)
                else:
                    self._start_runner()
            return await waiting.answer
        finally:
            if waiting in self._waiting:  # cancelled before it ran: it runs in no group
                self._waiting.remove(waiting)
                self._done(call)

    def _running(self) -> bool:
        return self._runner is not None and not self._runner.done()

    def _start_runner(self) -> None:
        self._runner = asyncio.create_task(self._run_all(), name=f"specdec-merge-{self.method}")

    async def _run_alone(self, waiting: _Waiting[C, R]) -> None:
        """The one call, with nobody to hold for, run in its caller's task: no hop through a
        runner task (a loop iteration of gRPC's poller each way). Calls arriving meanwhile
        wait, and a runner takes them on after it."""
        self._waiting.remove(waiting)
        self._alone = True
        try:
            await self._run([waiting])
        finally:
            self._alone = False
            if self._waiting and not self._running():
                self._start_runner()

    def _done(self, call: C) -> None:
        if (seen := self._seen.get(call.holder or "")) is not None:
            seen.in_flight = max(0, seen.in_flight - 1)

    async def _run_all(self) -> None:
        try:
            while self._waiting:
                await self._hold()
                group = self._take()
                if group:
                    await self._run(group)
        except Exception as error:  # a bug here must not leave callers waiting for ever
            log.exception("%s: the call merger failed; the calls waiting in it fail", self.method)
            for waiting in self._waiting:
                if not waiting.answer.done():
                    waiting.answer.set_exception(error)

    def _take(self) -> list[_Waiting[C, R]]:
        """Every waiting call with the first one's key, in arrival order."""
        if not self._waiting:
            return []
        key = self._waiting[0].call.key
        group = [w for w in self._waiting if w.call.key == key]
        self._waiting = [w for w in self._waiting if w.call.key != key]
        return group

    def _due(self) -> set[str]:
        """Holders with slots here, no call of this kind waiting or running, and no back-off
        (and the ones gone from here, no slot and no call, are forgotten, back-off and all)."""
        active, now = self.holders(), self.clock()
        for gone in [h for h, seen in self._seen.items() if h not in active and not seen.in_flight]:
            del self._seen[gone]
        return {holder for holder, seen in self._seen.items()
                if holder in active and not seen.in_flight and seen.skip_until <= now}

    async def _hold(self) -> None:
        """Wait, up to `max_wait_s`, for the holders that are due to send their calls."""
        if self.max_wait_s <= 0:
            return
        started = self.clock()
        until = started + self.max_wait_s
        waited: set[str] = set()
        missed: set[str] = set()
        while due := self._due():
            waited |= due
            left = until - self.clock()
            if left <= 0:
                missed = due
                break
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), min(left, POLL_S))
            except TimeoutError:
                pass
        if not waited:
            return
        now = self.clock()
        joined = 0
        for holder in waited:
            seen = self._seen.get(holder)
            if seen is None:  # it released its last slot meanwhile
                continue
            if holder in missed:
                seen.missed(now, self.first_backoff_s or FIRST_BACKOFF_HOLDS * self.max_wait_s,
                            self.max_backoff_s or MAX_BACKOFF_HOLDS * self.max_wait_s)
                log.debug("%s: %s did not call within %.0f ms: not waited for during %.2f s", self.method, holder,
                          (now - started) * 1e3, seen.backoff_s)
            else:
                seen.backoff_s = 0.0
                joined += 1
        self.stats.record_merge_wait(self.method, now - started, joined, len(missed))

    async def _run(self, group: list[_Waiting[C, R]]) -> None:
        calls = [w.call for w in group]
        began: list[float] = []  # when the worker took the run up

        def compute() -> list[tuple[Out | Exception, int]]:
            began.append(self.clock())
            return self._compute_each(calls)

        try:
            answers, seconds = await self.worker.run_timed(compute, functools.partial(self._encode_each, calls))
        except Exception as error:  # noqa: BLE001 - the worker itself failed (stopped): every caller hears
            answers, seconds = [(error, 0)] * len(group), 0.0
        except asyncio.CancelledError:  # the service stops, or a lone call's caller went away
            for waiting in group:
                self._done(waiting.call)
                waiting.answer.cancel()
            raise
        answered = self.clock()
        for waiting, (answer, run_items) in zip(group, answers):
            self._done(waiting.call)
            if waiting.answer.done():  # its caller went away
                continue
            if isinstance(answer, BaseException):
                waiting.answer.set_exception(answer)
            else:
                waiting.answer.set_result(Answer(answer, seconds, run_items, max(0.0, began[0] - waiting.arrived)))
        self.stats.record_work(self.method, seconds, sum(c.rows for c in calls), sum(c.tokens for c in calls))
        self._note_merge(calls, answered)

    def _compute_each(self, calls: list[C]) -> list[tuple[Out | Exception, int]]:
        """On the worker: all calls in one engine call; where that fails, each alone. Each
        outcome comes with the items of the engine call that gave it."""
        try:
            together = sum(call.rows for call in calls)
            return [(out, together) for out in self.compute(calls)]
        except Exception as error:
            if len(calls) == 1:
                return [(error, calls[0].rows)]
        outcomes: list[tuple[Out | Exception, int]] = []
        for call in calls:
            try:
                outcomes.append((self.compute([call])[0], call.rows))
            except Exception as error:  # noqa: BLE001 - this call's own answer
                outcomes.append((error, call.rows))
        return outcomes

    def _encode_each(self, calls: list[C], outcomes: list[tuple[Out | Exception, int]],
                     ) -> list[tuple[R | Exception, int]]:
        answers: list[tuple[R | Exception, int]] = []
        for call, (outcome, run_items) in zip(calls, outcomes):
            if isinstance(outcome, Exception):
                answers.append((outcome, run_items))
                continue
            try:
                answers.append((self.encode(call, outcome), run_items))
            except Exception as error:  # noqa: BLE001 - this call's own answer
                answers.append((error, run_items))
        return answers

    def _note_merge(self, calls: list[C], now: float) -> None:
        holders = {call.holder for call in calls}
        if len(holders) > 1:
            self.stats.record_merged(self.method, len(calls))
            if self._merged_at is None:
                log.info("%s: merging the calls of %d gateways into one forward", self.method, len(holders))
            self._merged_at = now
        elif self._merged_at is not None and now - self._merged_at > QUIET_S:
            log.info("%s: no calls merged for %.0f s", self.method, now - self._merged_at)
            self._merged_at = None
