"""The gateway's one scheduler: admission between rounds, then batched rounds for all requests.

A single asyncio task owns every `Request`; each request's stream leaves through its
`Request.events` (the front's `Generation`), so nothing here holds a client's queue. Each
iteration it (1) retires cancelled requests, (2) admits waiting requests while both services
have slot and KV room for them (one batched Prefill, then `first_tokens`), and (3) runs
one speculation round —
ONE batched Propose and ONE batched Verify — for every running request.

KV blocks are counted on demand, as vLLM does: a request is admitted when its prompt and
one round fit, and it grows a round at a time. When a round would not fit a pool, the
most recently admitted request is preempted — its slots are freed in both services and
it goes back to the head of the queue with the tokens it has, to be prefilled again
(prompt + generated so far) when room returns. A request asking for 10**9 tokens can
therefore never hold blocks it has not used yet, and short requests keep flowing. Pools
shared with other gateways hold what their services last reported free as well, and
can refuse a call for room all the same: that queues or preempts too (`gateway.pools`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time

import grpc

from specdec.errors import CapacityExhaustedError, ServiceStateError, SpecdecError
from specdec.gateway import target_outage
from specdec.gateway.deadlines import Deadlines
from specdec.gateway.draft_sources import DraftSource
from specdec.gateway.first_tokens import first_tokens_and_logprobs
from specdec.gateway.grammar.rounds import with_forced_tokens
from specdec.gateway.model_clients import DraftAPI, TargetAPI
from specdec.gateway.planner import DraftAvailability, Planner, RoundInputs
from specdec.gateway.pools import PoolContention, PoolLimits, PoolRooms, refused_for_room, round_blocks
from specdec.gateway.proposers import LookupDraft, LookupProposer
from specdec.gateway.request import FinishReason, Request
from specdec.gateway.rounds import ProposeOutcome, RoundPlan, RoundReport
from specdec.gateway.slot_releases import SlotReleases
from specdec.gateway.speculative_step import plan_k, plan_steps, run_round
from specdec.gateway.stats import GatewayStats
from specdec.gateway.target_outage import TargetOutage, explained_by_restart
from specdec.serving.errors import status_of
from specdec.serving.serial_executor import SerialExecutor, cancel_and_wait
from specdec.wire.items import PrefillItem
from specdec.wire.model_info import PoolRoom

log = logging.getLogger(__name__)
#: How often a degraded draft's health is checked.
DRAFT_RECHECK_S = 1.0
#: Codes of a call that did not reach the service's own logic (their details name addresses).
_TRANSPORT_FAILURES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED,
})


def _stopping() -> bool:
    """Whether the running task itself is being cancelled (the gateway stopping)."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


class Scheduler:
    def __init__(
        self,
        target: TargetAPI,
        draft: DraftAPI | None,
        pools: list[PoolLimits],
        *,
        max_seq_len: int,
        max_batch_size: int,
        max_queue: int,
        planner: Planner,
        stats: GatewayStats,
        deadlines: Deadlines,
        decode_steps: int = 1,
        lookup: LookupProposer | None = None,
        grammar_drafts: bool = True,
    ) -> None:
        self.target = target
        self.draft = draft
        #: Proposes lookup drafts for the requests that allow them (None: no lookups).
        self.lookup = lookup
        #: Structured-output requests draft their grammar's forced tokens (`with_forced_tokens`).
        self.grammar_drafts = grammar_drafts
        self.pools = pools
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.planner = planner
        self.stats = stats
        self.deadlines = deadlines
        #: Tokens a plain round may decode per request in one Verify (multi-step).
        self.decode_steps = decode_steps
        #: A Propose failed or missed its deadline: rounds decode plainly until the draft's
        #: health check answers SERVING again (checked by `_watch_draft`).
        self.draft_degraded = False
        #: The draft came back incompatible (another tokenizer, a smaller maximum K; see
        #: `service_changes`): no speculation until it is compatible again.
        self.draft_refused = False
        self._draft_watch: asyncio.Task[None] | None = None
        self.releases = SlotReleases(target, draft, lambda: self.deadlines.control())
        self.outage = TargetOutage()
        #: The batch limit while pools shared with other gateways refuse this one room.
        self.contention = PoolContention(max_batch_size, stats)
        #: The room each service last reported: admission and preemption keep within it.
        self.rooms = PoolRooms()
        for pool in pools:  # one request alone always fits, so preemption always makes progress
            if pool.blocks_for(max_seq_len) > pool.num_blocks:
                raise ValueError(f"the {pool.name} pool ({pool.total_kv_tokens} tokens) cannot hold "
                                 f"max_seq_len {max_seq_len}")
        self.waiting: collections.deque[Request] = collections.deque()
        #: In admission order: the last one is the first to be preempted.
        self.running: list[Request] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: Sampling and acceptance are tensor work: off the event loop, on one thread (see
        #: `specdec.serving.serial_executor`), which also keeps one OpenMP thread team per process.
        self.sampler = SerialExecutor("gateway-sampler")

    # -- public ------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="specdec-scheduler")

    async def stop(self) -> None:
        await self.releases.stop()
        await cancel_and_wait(self._draft_watch)
        await cancel_and_wait(self._task)
        for seq in [*self.waiting, *self.running]:
            seq.finish(FinishReason.ERROR, "gateway shutting down", grpc.StatusCode.UNAVAILABLE.name)
        held = {seq.slot_id: seq for seq in [*self.releases.pending(), *self.running]}
        await asyncio.gather(*(self.releases.release(seq) for seq in held.values()), return_exceptions=True)
        await asyncio.to_thread(self.sampler.shutdown)

    def submit(self, seq: Request) -> None:
        """Queue a request (validated by the caller). RESOURCE_EXHAUSTED when the queue is full."""
        if len(self.waiting) >= self.max_queue:
            raise CapacityExhaustedError(f"admission queue is full ({self.max_queue} waiting)", resource="queue")
        self.waiting.append(seq)
        self.stats.waiting = len(self.waiting)
        self._wakeup.set()

    def cancel(self, seq: Request) -> None:
        """Called from the RPC handler when the client goes away (cancelled, or its deadline
        passed). A waiting request leaves the queue at once; a running one is retired
        between rounds, which frees its slots in both services."""
        seq.cancelled = True
        if seq in self.waiting:
            self.waiting.remove(seq)
            self.stats.waiting = len(self.waiting)
            seq.finish(FinishReason.CANCELLED)
            self._record_finished(seq)
        self._wakeup.set()

    # -- loop --------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            try:
                await self._iteration()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 - a bug fails the requests in flight, never the loop
                await self._fail(list(self.running), error)

    async def _iteration(self) -> None:
        await self._retire_cancelled()
        # Requests that arrived during an admission's Prefill are admitted before the round as
        # well (once, so a steady stream of arrivals cannot stall decoding). A burst then starts
        # in two Prefills, and its first round plans K for the whole burst rather than for the
        # first arrival alone (docs/performance.md#adaptive-k-planner-rules).
        if await self._admit() and self.waiting:
            await self._admit()
        if not self.running:
            self._wakeup.clear()
            if not self.waiting:
                await self._wakeup.wait()
            elif self.outage.down:  # tried again after RETRY_S, or when its Info answers (`wake`)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), target_outage.RETRY_S)
            elif not self.contention.may_try():  # refused for room with nothing held: back off
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), self.contention.wait_s())
            elif not self._queue_head_fits():  # a service's fresh word of no room: until it ages
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), self.rooms.fresh_for_s())
            return
        await self._round()

    async def _round(self) -> None:
        await self._make_room()
        batch = list(self.running)
        plan = self._plan(batch)
        before = {s.slot_id: (s.completion_tokens, s.last_token_at) for s in batch}
        try:
            report = await run_round(self.target, self.draft, batch, plan, self.sampler, self.max_seq_len,
                                     self.deadlines, self.planner.kv_handoff)
        except Exception as error:  # noqa: BLE001 - a failed round fails its requests, not the gateway
            if refused_for_room(error):
                self._refused("target", "Verify", batch, kept=batch[:-1])
                await self._preempt(self.running[-1])  # the target changed nothing: the others retry
            elif explained_by_restart(error):
                await self._lost_target(batch, error)
            else:
                await self._fail(batch, error)
            return
        except asyncio.CancelledError:
            if _stopping():
                raise
            # A call the round awaited was cancelled inside grpc, not this task: without this
            # the CancelledError would end the scheduler and leave every stream waiting.
            await self._fail(batch, ServiceStateError("a call to a model service was cancelled"))
            return
        for wait_s in self.outage.resumed(batch):
            self.stats.resume_time.observe(wait_s)
        if report.propose_outcome is ProposeOutcome.FAILED:
            self.stats.draft_failures += 1
            self.stats.off_rounds["draft_unavailable"] += 1
            self._degrade_draft()
        elif report.propose_outcome is ProposeOutcome.NO_ROOM:  # the next round preempts the newest
            self._refused("draft", "Propose", batch, kept=batch[:-1])
        self._saw_rooms(target=report.verify.room, draft=report.propose.room)
        self.stats.kv_handoff_tokens += report.handoff_tokens
        self.planner.observe(plan, batch, report)
        self.stats.planner = self.planner.status()
        self._record_round(batch, report, before)
        for seq in batch:
            if seq.done:
                await self._retire(seq, seq.finish_reason)  # type: ignore[arg-type]

    def _plan(self, batch: list[Request]) -> RoundPlan:
        """The planner's plan for the round, from the batch's facts: each request's room for draft
        tokens and plain steps (one a round while a waiting request could join at the next
        round; more when the batch or a pool is full and throughput counts), its lookup
        proposal, and whether the draft can be called."""
        caps = {s.slot_id: plan_k(s, self.max_seq_len) for s in batch}
        limit = 1 if self._queue_head_fits() else self.decode_steps
        plan = self.planner.plan(RoundInputs(
            batch=batch, caps=caps, plain_steps={s.slot_id: plan_steps(s, self.max_seq_len, limit) for s in batch},
            lookups=self._lookups(batch, caps), lookup_enabled=self.lookup is not None, draft=self._draft_availability,
        ))
        if plan.off_reason is not None:
            self.stats.off_rounds[plan.off_reason] += 1
        if not self.grammar_drafts:
            return dataclasses.replace(plan, grammar_drafts=False)
        return with_forced_tokens(plan, batch, caps, self.planner.costs.forced_prefix_pays)

    @property
    def _draft_availability(self) -> DraftAvailability:
        if self.draft is None:
            return DraftAvailability.NONE
        return DraftAvailability.DOWN if self.draft_degraded or self.draft_refused else DraftAvailability.READY

    def _lookups(self, batch: list[Request], caps: dict[str, int]) -> dict[str, LookupDraft]:
        """This round's lookup proposal of each request that allows lookups and has one."""
        if self.lookup is None:
            return {}
        out = {}
        for seq in batch:
            if caps[seq.slot_id] > 0 and seq.method.allows_lookup:
                draft = self.lookup.propose(seq.slot_id, seq.tokens, caps[seq.slot_id], seq.stop_token_ids)
                if draft is not None:
                    out[seq.slot_id] = draft
        return out

    def _record_round(
        self, batch: list[Request], report: RoundReport, before: dict[str, tuple[int, float | None]]
    ) -> None:
        phases = report.phases()
        self.stats.record_phases(phases, report)
        for seq in batch:
            k, accepted = report.ks[seq.slot_id], report.num_accepted[seq.slot_id]
            source = report.sources.get(seq.slot_id, DraftSource.MODEL)
            forced = k if source is DraftSource.GRAMMAR else report.forced.get(seq.slot_id, (0, 0))[0]
            seq.counts.record(k, accepted, source, report.guessed.get(seq.slot_id, 0), forced)
            seq.anatomy.add(phases)
            self.stats.record_round(k, accepted, report.steps_of(seq.slot_id), source, forced)
            count, last_at = before[seq.slot_id]
            if seq.completion_tokens > count and seq.last_token_at is not None and last_at is not None:
                self.stats.record_tokens(seq.completion_tokens - count, seq.last_token_at - last_at)

    async def _admit(self) -> int:
        """Admit waiting requests that fit, in FIFO order, with one batched Prefill; returns
        how many were admitted."""
        for seq in self.outage.expired(self.waiting):
            self.waiting.remove(seq)
            seq.finish(FinishReason.ERROR, f"the target service answered {self.outage.code.name} and did not come "
                       f"back within {target_outage.RESUME_WITHIN_S:.0f} s", grpc.StatusCode.UNAVAILABLE.name)
            self._record_finished(seq)
        if not self.outage.may_try() or not self.contention.may_try():
            return 0
        admitted: list[Request] = []
        while self.waiting and len(self.running) + len(admitted) < self.max_batch_size:
            seq = self.waiting[0]
            if seq.cancelled:
                self.waiting.popleft()
                seq.finish(FinishReason.CANCELLED)
                self._record_finished(seq)
                continue
            if not self._admits(seq, admitted) or (admitted and self.contention.probing):
                break  # FIFO: the head waits for room; later requests do not overtake it
            admitted.append(self.waiting.popleft())
            if seq.admitted_at is None:
                seq.admitted_at = time.perf_counter()
        self.stats.waiting = len(self.waiting)
        if not admitted:
            return 0
        try:
            # A preempted request resumes here: its prompt and generated tokens are prefilled again.
            timeout = self.deadlines.prefill(len(admitted), max(len(s.tokens) for s in admitted))
            items = [PrefillItem(s.slot_id, s.tokens, s.declared_len) for s in admitted]
            prefilled = await self.target.prefill(items, timeout)
            self.stats.rpc_latency["Prefill"].observe(prefilled.wall_s)
            logits = {slot: chunk.logits for slot, chunk in prefilled.value.items()}
        except Exception as error:  # noqa: BLE001
            if refused_for_room(error):  # it made no slot: the requests wait at the head of the queue
                self._refused("target", "Prefill", self.running, kept=self.running)
                self.waiting.extendleft(reversed(admitted))
                self.stats.waiting = len(self.waiting)
            elif explained_by_restart(error):
                # First again, in their order, under fresh slot ids: a Prefill that timed out may
                # have made its slots all the same (they are released, best effort).
                self.outage.lost(admitted, error.code())
                await self._requeue(admitted)
            else:
                await self._fail(admitted, error, release=False)
            return 0
        self.outage.answered()
        self.contention.admitted()
        self._saw_rooms(target=prefilled.room)
        self.running.extend(admitted)  # they hold target slots now: a failure below releases them
        firsts, logprobs = await self.sampler.run(first_tokens_and_logprobs, admitted, logits)
        for seq in admitted:
            count, last_at = seq.completion_tokens, seq.last_token_at
            if seq.preemptions == 0:
                self.stats.prompt_tokens += len(seq.prompt)
            seq.target_valid = len(seq.tokens)
            seq.emit([firsts[seq.slot_id]], self.max_seq_len, logprobs.get(seq.slot_id))
            gap = None if last_at is None or seq.last_token_at is None else seq.last_token_at - last_at
            self.stats.record_tokens(seq.completion_tokens - count, gap)
            if seq.done:
                await self._retire(seq, seq.finish_reason)  # type: ignore[arg-type]
        self.stats.running = len(self.running)
        return len(admitted)

    # -- draft health ------------------------------------------------------------------

    def _degrade_draft(self) -> None:
        """Stop speculating until the draft's health check passes again."""
        self.draft_degraded = True
        self.stats.speculation_enabled = 0
        if self._draft_watch is None or self._draft_watch.done():
            self._draft_watch = asyncio.create_task(self._watch_draft(), name="specdec-draft-watch")

    async def _watch_draft(self) -> None:
        assert self.draft is not None
        while not await self.draft.serving(self.deadlines.control()):
            await asyncio.sleep(DRAFT_RECHECK_S)
        log.info("the draft answers its health check again: speculation resumes")
        self.planner.service_restarted("draft")
        self.draft_degraded = False
        self.stats.speculation_enabled = 1
        self._wakeup.set()

    # -- bookkeeping -------------------------------------------------------------------

    def set_pool(self, pool: PoolLimits) -> None:
        """A service came back with another KV pool or slot count: admit against it from now on
        (the next round preempts what no longer fits)."""
        self.pools = [pool if old.name == pool.name else old for old in self.pools]
        self.rooms.forget(pool.name)
        self._wakeup.set()

    def _saw_rooms(self, **rooms: PoolRoom | None) -> None:
        """The room each service reported with its last response, by pool name."""
        for pool in self.pools:
            self.rooms.seen(pool, rooms.get(pool.name))
        if self.rooms.reporting.issuperset(pool.name for pool in self.pools):
            self.contention.lift()

    def _refused(self, service: str, call: str, held: list[Request], kept: list[Request]) -> None:
        """`service` refused `call` for room while the gateway held `held` there; it keeps
        `kept`, whose next round is all it may hold there until the service's next response."""
        pool = next(p for p in self.pools if p.name == service)
        blocks = round_blocks(pool, kept, self.max_seq_len, self.decode_steps)
        reported = self.rooms.refused(service, blocks, len(kept))
        self.contention.refused(service, call, len(held), room_reported=reported)

    def _queue_head_fits(self) -> bool:
        """Whether the first waiting request would be admitted now."""
        return bool(self.waiting) and self._admits(self.waiting[0], [])

    def _admits(self, seq: Request, admitted: list[Request]) -> bool:
        """Whether `seq` joins the batch after `admitted`: the batch has room, and so have the
        pools (with a spare block per running request, so that it is not preempted at once; and
        at their whole length beside every request's reserved growth, while pools are shared)."""
        before = len(self.running) + len(admitted)
        return (before < self.contention.current_limit()
                and self._fits([*self.running, *admitted, seq], headroom=before)
                and self.rooms.reserves(self.pools, [*admitted, seq], self.max_seq_len))

    def _fits(self, seqs: list[Request], headroom: int = 0) -> bool:
        """Whether every pool holds the next round of all `seqs` (and `headroom` spare blocks:
        at admission, one per running request, so that a newcomer is not preempted at once),
        within the room its service last reported (`PoolRooms`)."""
        return self.rooms.fits(self.pools, seqs, headroom, self.max_seq_len, self.decode_steps)

    async def _make_room(self) -> None:
        """Preempt the most recently admitted requests until the next round fits every pool and
        the batch limit (`contention`), keeping one."""
        while len(self.running) > 1 and (len(self.running) > self.contention.current_limit()
                                         or not self._fits(self.running)):
            await self._preempt(self.running[-1])

    async def _preempt(self, seq: Request) -> None:
        """Free the request's slots in both services and queue it first, to resume from its tokens."""
        log.info("preempted %s at %d tokens to make room in the KV pools", seq.slot_id, len(seq.tokens))
        await self._requeue([seq])
        self.stats.preemptions += 1

    async def _lost_target(self, seqs: list[Request], error: grpc.aio.AioRpcError) -> None:
        """The target failed the round in a way a restart explains: the requests wait for it at
        the head of the queue, to resume from their tokens (`gateway.target_outage`)."""
        log.warning("the target failed a round (%s): %d request(s) wait up to %.0f s for it, to resume from "
                    "their tokens", error.code().name, len(seqs), target_outage.RESUME_WITHIN_S)
        self.outage.lost(seqs, error.code())
        await self._requeue(seqs)

    async def _requeue(self, seqs: list[Request]) -> None:
        """Free the requests' slots (those still there) and queue them first, in their order,
        under fresh slot ids: the next admission prefills their prompt and generated tokens."""
        for seq in seqs:
            if seq in self.running:
                self.running.remove(seq)
            self.planner.forget(seq)
            if self.lookup is not None:
                self.lookup.forget(seq.slot_id)  # the slot id changes: the index is rebuilt under the new one
        await asyncio.gather(*(self.releases.release(seq) for seq in seqs))
        for seq in reversed(seqs):
            seq.preempt()
            self.waiting.appendleft(seq)
        self.stats.running, self.stats.waiting = len(self.running), len(self.waiting)

    def wake(self) -> None:
        """Try admission now (the target answers its Info again)."""
        self._wakeup.set()

    async def _retire_cancelled(self) -> None:
        for seq in [s for s in self.running if s.cancelled]:
            await self._retire(seq, FinishReason.CANCELLED)

    async def _retire(self, seq: Request, reason: FinishReason, error: str = "", status: str = "INTERNAL") -> None:
        if seq in self.running:
            self.running.remove(seq)
        seq.finish(reason, error, status)
        self.planner.forget(seq)
        if self.lookup is not None:
            if reason in (FinishReason.STOP, FinishReason.LENGTH):  # a whole answer: later ones may reuse it
                self.lookup.finish(seq.slot_id, seq.prompt, seq.tokens[len(seq.prompt):])
            else:
                self.lookup.forget(seq.slot_id)
        # Count the request before the first await: its client cannot read the final
        # message (and scrape) before these counters include it.
        self._record_finished(seq)
        await self.releases.release(seq)

    def _record_finished(self, seq: Request) -> None:
        self.stats.running = len(self.running)
        self.stats.record_finished(seq)

    async def _fail(self, seqs: list[Request], error: Exception, *, release: bool = True) -> None:
        if isinstance(error, grpc.aio.AioRpcError):
            status = error.code()
            log.error("failing %d request(s): %s from the target: %s", len(seqs), status.name, error.details())
            # Transport failures carry the service's internal address: clients get the code only.
            detail = "" if status in _TRANSPORT_FAILURES else f": {error.details()}"
            message = f"the target service answered {status.name}{detail}" + (
                "; the gateway log has the details" if not detail else ""
            )
        elif isinstance(error, SpecdecError):
            status, message = status_of(error)
            log.error("failing %d request(s): %s", len(seqs), message)
        else:
            status, message = grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}"
            log.exception("failing %d request(s)", len(seqs), exc_info=error)
        for seq in seqs:
            if release:
                await self._retire(seq, FinishReason.ERROR, message, status.name)
            else:
                seq.finish(FinishReason.ERROR, message, status.name)
                self._record_finished(seq)
