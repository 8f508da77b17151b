"""Pools shared with other gateways (`specdec.gateway.pools`): a model service that refuses a
call for room makes the gateway queue or preempt, never fail a request, and the gateway's
lowered batch limit rises again once the others leave; a service that reports its room with
every call is admitted and preempted against, while the report is fresh. Fakes whose pools
another gateway fills; the real two-gateway stack is tests/gateway/test_shared_admission.py."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
import pytest

from specdec.errors import CAPACITY_TRAILER
from specdec.gateway import pools
from specdec.gateway.model_clients import Timed
from specdec.gateway.pools import PoolContention, PoolLimits, PoolRooms, refused_for_room
from specdec.gateway.request import FinishReason
from specdec.gateway.scheduler import Scheduler
from specdec.gateway.stats import GatewayStats
from specdec.wire.items import PrefillItem, ProposeItem, VerifyItem
from specdec.wire.model_info import PoolRoom
from tests.support.fakes import FakeDraft, FakeTarget, greedy_reference, policy, rpc_error, until
from tests.unit.gateway.test_scheduler import drain, new_request, prompt_ids, request, run

BLOCK = 16
T = TypeVar("T")


def no_room(what: str = "kv_blocks") -> grpc.aio.AioRpcError:
    """A model service's refusal for room, as `specdec.serving.errors` sends it."""
    trailers = grpc.aio.Metadata((CAPACITY_TRAILER, what))
    return grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), trailers,
                                "KV pool: a batch of 2 appends needs 3 more blocks, 1 free")


@dataclass
class SharedPool:
    """A pool of `blocks` that another gateway holds `others` of."""

    blocks: int
    others: int = 0
    refusals: int = 0

    def check(self, slots: dict[str, list[int]], grown: dict[str, int]) -> None:
        """Refuse (changing nothing) unless every slot, at its `grown` length where given, fits."""
        lengths = {slot: len(tokens) for slot, tokens in slots.items()} | grown
        if sum(-(-n // BLOCK) for n in lengths.values()) + self.others > self.blocks:
            self.refusals += 1
            raise no_room()

    def room(self, slots: dict[str, list[int]]) -> PoolRoom:
        """What a service reports after a call: the free blocks and slots, and the caller's."""
        held = sum(-(-len(tokens) // BLOCK) for tokens in slots.values())
        return PoolRoom(max(0, self.blocks - held - self.others), 64 - len(slots), held, len(slots))


@dataclass
class SharedTarget(FakeTarget):
    pool: SharedPool = field(default_factory=lambda: SharedPool(10**6))
    #: Every response reports the pool's room (False: a service from before the report).
    reports_room: bool = False

    async def prefill(self, items: list[PrefillItem], timeout: float):  # type: ignore[no-untyped-def]
        self.pool.check(self.slots, {item.slot_id: len(item.prompt_tokens) for item in items})
        return self._with_room(await super().prefill(items, timeout))

    async def verify(self, items: list[VerifyItem], timeout: float):  # type: ignore[no-untyped-def]
        self.pool.check(self.slots, {item.slot_id: item.valid_len + len(item.tokens) for item in items})
        return self._with_room(await super().verify(items, timeout))

    def _with_room(self, timed: Timed[T]) -> Timed[T]:
        return dataclasses.replace(timed, room=self.pool.room(self.slots)) if self.reports_room else timed


@dataclass
class SharedDraft(FakeDraft):
    pool: SharedPool = field(default_factory=lambda: SharedPool(10**6))
    reports_room: bool = False

    async def propose(self, items: list[ProposeItem], timeout: float):  # type: ignore[no-untyped-def]
        grown = {item.slot_id: item.valid_len + len(item.new_tokens) + item.num_speculative_tokens for item in items}
        self.pool.check(self.slots, grown)
        timed = await super().propose(items, timeout)
        return dataclasses.replace(timed, room=self.pool.room(self.slots)) if self.reports_room else timed


@pytest.fixture(autouse=True)
def quick_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pools, "PROBE_S", 0.05)
    monkeypatch.setattr(pools, "FIRST_BACKOFF_S", 0.01)


async def all_finish(sched: Scheduler, n: int, max_new_tokens: int = 40) -> None:
    """Submit `n` requests at once; each must end LENGTH with the target's greedy output."""
    seqs = [new_request(request(max_new_tokens=max_new_tokens), policy()) for _ in range(n)]
    for seq in seqs:
        sched.submit(seq)
    for tokens, finished in await asyncio.gather(*(drain(seq, timeout=30) for seq in seqs)):
        assert finished.reason == FinishReason.LENGTH, finished
        assert tokens == greedy_reference(prompt_ids(), max_new_tokens)


def test_a_target_pool_filled_by_another_gateway_queues_and_preempts_without_failing_a_request() -> None:
    # 4 requests of 5 + 40 tokens need 3 blocks each at the end; the other gateway leaves 7.
    target, draft = SharedTarget(pool=SharedPool(blocks=12, others=5)), FakeDraft()

    async def test(sched: Scheduler) -> None:
        await all_finish(sched, 4)
        assert target.pool.refusals > 0 and sched.stats.pool_refusals["target"] == target.pool.refusals
        assert sched.stats.preemptions > 0 and sched.stats.admission_limit < 8
        assert sched.stats.speculation_enabled == 1  # a refusal for room is no failure of the services
        target.pool.others = 0  # the other gateway left: the limit climbs back to the batch size
        await asyncio.sleep(10 * pools.PROBE_S)
        assert sched.contention.current_limit() == 8
        await all_finish(sched, 8, max_new_tokens=8)

    run(test, target, draft)


def test_a_gateway_holding_nothing_backs_off_until_the_other_gateway_leaves() -> None:
    target, draft = SharedTarget(pool=SharedPool(blocks=8, others=8)), FakeDraft()

    async def test(sched: Scheduler) -> None:
        seq = new_request(request(max_new_tokens=10), policy())
        sched.submit(seq)
        await until(lambda: target.pool.refusals >= 3)  # retried...
        tries = target.pool.refusals
        await asyncio.sleep(0.3)
        assert target.pool.refusals - tries <= 10  # ...on a doubling backoff, not spinning
        assert not seq.done and not target.prefilled
        target.pool.others = 0
        tokens, finished = await drain(seq)
        assert finished.reason == FinishReason.LENGTH and tokens == greedy_reference(prompt_ids(), 10)

    run(test, target, draft)


def test_a_full_draft_pool_costs_speculation_and_preempts_not_the_draft_itself() -> None:
    target, draft = FakeTarget(), SharedDraft(pool=SharedPool(blocks=10, others=4))

    async def test(sched: Scheduler) -> None:
        await all_finish(sched, 4)
        assert draft.pool.refusals > 0 and sched.stats.pool_refusals["draft"] == draft.pool.refusals
        assert sched.stats.draft_failures == 0 and sched.stats.speculation_enabled == 1
        assert sched.stats.preemptions > 0

    run(test, target, draft)


def test_a_resource_exhausted_that_is_not_a_refusal_for_room_still_fails() -> None:
    """gRPC's own RESOURCE_EXHAUSTED (a message over the size limit) would fail again on a retry."""
    too_big = rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (5000 vs. 4096)")
    assert not refused_for_room(too_big) and refused_for_room(no_room())
    target = FakeTarget(fail_verify=too_big)

    async def test(sched: Scheduler) -> None:
        seq = new_request(request(max_new_tokens=10), policy())
        sched.submit(seq)
        _, finished = await drain(seq)
        assert finished.reason == FinishReason.ERROR and sched.stats.pool_refusals == {"target": 0, "draft": 0}

    run(test, target, FakeDraft())


def test_the_limit_drops_on_refusals_and_rises_one_a_probe() -> None:
    now = [0.0]
    stats = GatewayStats(8)
    contention = PoolContention(8, stats, clock=lambda: now[0])
    contention.refused("target", "Verify", 6)
    assert contention.current_limit() == stats.admission_limit == 5 and contention.may_try()
    contention.refused("draft", "Propose", 1)  # never below one
    contention.refused("target", "Prefill", 3)  # a Prefill refusal keeps what is held: never raises the limit
    assert contention.current_limit() == 1 and stats.pool_refusals == {"target": 2, "draft": 1}
    now[0] += 1.5 * pools.PROBE_S
    assert contention.current_limit() == contention.current_limit() == 2  # one step per probe
    now[0] += 0.5 * pools.PROBE_S
    assert contention.current_limit() == 3
    now[0] += 10 * pools.PROBE_S
    assert contention.current_limit() == stats.admission_limit == 8  # up to the batch size, no further
    contention.refused("target", "Prefill", 0)  # holding nothing: back off
    assert not contention.may_try() and 0 < contention.wait_s() <= 1.5 * pools.FIRST_BACKOFF_S


def test_a_pool_that_reports_little_room_preempts_before_the_round_instead_of_being_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As the first test's pool, but every response says how much is free: nothing is refused.
    # Reports never age here, so a slow round on a busy machine cannot outlive one.
    monkeypatch.setattr(pools, "ROOM_FRESH_S", 600.0)
    target, draft = SharedTarget(pool=SharedPool(blocks=12, others=5), reports_room=True), FakeDraft()

    async def test(sched: Scheduler) -> None:
        await all_finish(sched, 4)
        assert target.pool.refusals == 0 and sched.stats.preemptions > 0
        assert sched.stats.admission_limit == 8

    run(test, target, draft)


def test_a_refusal_from_a_pool_that_reports_its_room_preempts_without_lowering_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pools, "PROBE_S", 60.0)  # a lowered limit would stay lowered
    target = SharedTarget(pool=SharedPool(blocks=14), reports_room=True)

    async def test(sched: Scheduler) -> None:
        async def another_gateway_arrives() -> None:  # after a response said the pool was free
            await until(lambda: len(target.verify_batches) >= 3)
            target.pool.others = 10

        arrives = asyncio.create_task(another_gateway_arrives())
        await all_finish(sched, 4)
        await arrives
        assert target.pool.refusals >= 1 and sched.stats.pool_refusals["target"] == target.pool.refusals
        assert sched.stats.preemptions > 0 and sched.stats.admission_limit == 8

    run(test, target, FakeDraft())


def test_the_first_report_of_room_lifts_a_limit_learned_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pools, "PROBE_S", 60.0)
    target = SharedTarget(pool=SharedPool(blocks=8, others=8), reports_room=True)
    draft = SharedDraft(reports_room=True)

    async def test(sched: Scheduler) -> None:
        seq = new_request(request(max_new_tokens=10), policy())
        sched.submit(seq)
        await until(lambda: target.pool.refusals >= 1)  # not known to report yet: the limit drops
        assert sched.stats.admission_limit == 1
        target.pool.others = 0
        tokens, finished = await drain(seq)
        assert finished.reason == FinishReason.LENGTH and tokens == greedy_reference(prompt_ids(), 10)
        assert sched.stats.admission_limit == 8 and sched.rooms.reporting == {"target", "draft"}

    run(test, target, draft)


def test_a_fresh_report_bounds_what_the_gateway_may_hold_and_a_stale_one_is_ignored() -> None:
    now = [0.0]
    rooms, pool = PoolRooms(clock=lambda: now[0]), PoolLimits("target", 100 * BLOCK, BLOCK, 10)
    assert rooms.capacity(pool) == (100, 10) and rooms.fresh_for_s() == 0.0  # no word yet: the whole pool
    rooms.seen(pool, PoolRoom(free_blocks=30, free_slots=4, held_blocks=20, held_slots=2))
    assert rooms.capacity(pool) == (50, 6)
    rooms.seen(pool, None)  # no report (an older service, or no call): the last one stands
    now[0] += 0.5 * pools.ROOM_FRESH_S
    assert rooms.capacity(pool) == (50, 6) and rooms.fresh_for_s() == pytest.approx(0.5 * pools.ROOM_FRESH_S)
    now[0] += pools.ROOM_FRESH_S
    assert rooms.capacity(pool) == (100, 10) and rooms.fresh_for_s() == 0.0
    rooms.seen(pool, PoolRoom(free_blocks=500, free_slots=50, held_blocks=0, held_slots=0))
    assert rooms.capacity(pool) == (100, 10)  # never past the pool's own size


def test_a_refusal_marks_the_pool_full_until_the_next_report() -> None:
    now = [0.0]
    rooms, pool = PoolRooms(clock=lambda: now[0]), PoolLimits("target", 100 * BLOCK, BLOCK, 10)
    assert not rooms.refused("target", 3, 1) and rooms.capacity(pool) == (100, 10)  # not known to report
    rooms.seen(pool, PoolRoom(free_blocks=30, free_slots=4, held_blocks=20, held_slots=2))
    assert rooms.refused("target", 12, 1) and rooms.capacity(pool) == (12, 1)
    rooms.seen(pool, PoolRoom(free_blocks=8, free_slots=4, held_blocks=20, held_slots=2))
    assert rooms.capacity(pool) == (28, 6)
    rooms.refused("target", 12, 1)
    now[0] += 2 * pools.ROOM_FRESH_S  # a mark ages out as a report does
    assert rooms.capacity(pool) == (100, 10)
    rooms.seen(pool, PoolRoom(free_blocks=8, free_slots=4, held_blocks=20, held_slots=2))
    assert rooms.refused("target", 0, 0) and rooms.capacity(pool) == (100, 10)  # keeping nothing: no word
    rooms.forget("target")  # the service came back with another pool
    assert not rooms.reporting


def test_a_shared_pool_admits_a_request_only_at_its_whole_length_beside_the_reserved_growth() -> None:
    rooms, pool = PoolRooms(), PoolLimits("target", 100 * BLOCK, BLOCK, 10)
    seq = new_request(request(max_new_tokens=10 * BLOCK), policy())  # whole length: 11 blocks and a bit
    whole = pool.blocks_for(seq.max_len)
    assert rooms.reserves([pool], [seq], 100 * BLOCK)  # no word: the service decides
    rooms.seen(pool, PoolRoom(free_blocks=whole, free_slots=4, held_blocks=20, held_slots=2))
    assert rooms.reserves([pool], [seq, seq], 100 * BLOCK)  # nothing reserved: the pool is this gateway's alone
    rooms.seen(pool, PoolRoom(free_blocks=whole + 5, free_slots=4, held_blocks=20, held_slots=2, reserved_blocks=5))
    assert rooms.reserves([pool], [seq], 100 * BLOCK) and not rooms.reserves([pool], [seq, seq], 100 * BLOCK)
    rooms.seen(pool, PoolRoom(free_blocks=whole + 5, free_slots=4, held_blocks=20, held_slots=2, reserved_blocks=6))
    assert not rooms.reserves([pool], [seq], 100 * BLOCK)
    assert rooms.reserves([pool], [seq], 2 * BLOCK)  # counted up to the context's length only


@dataclass
class CountingTarget(SharedTarget):
    """Records each Prefill's size and whether the pool took it."""

    prefills: list[tuple[int, bool]] = field(default_factory=list)

    async def prefill(self, items: list[PrefillItem], timeout: float):  # type: ignore[no-untyped-def]
        try:
            timed = await super().prefill(items, timeout)
        except grpc.aio.AioRpcError:
            self.prefills.append((len(items), False))
            raise
        self.prefills.append((len(items), True))
        return timed


def test_a_gateway_refused_holding_nothing_tries_one_request_at_a_time() -> None:
    target = CountingTarget(pool=SharedPool(blocks=8), reports_room=True)
    first = new_request(request(max_new_tokens=40), policy())
    later = [new_request(request(max_new_tokens=20), policy()) for _ in range(2)]

    async def test(sched: Scheduler) -> None:
        sched.submit(first)
        await until(lambda: len(target.verify_batches) >= 2)
        target.pool.others = 8  # another gateway takes the pool: `first` is preempted, nothing is held
        for seq in later:
            sched.submit(seq)
        await until(lambda: target.pool.refusals >= 4)
        target.pool.others = 0  # the other gateway's requests end
        for seq in [first, *later]:
            _, finished = await drain(seq)
            assert finished.reason == FinishReason.LENGTH

    run(test, target, None)
    after = target.prefills[1:]  # the Prefills after `first`'s own
    first_in = next(i for i, (_, ok) in enumerate(after) if ok)
    assert first_in >= 2 and all(size == 1 for size, _ in after[:first_in + 1])  # one at a time until one is in
    assert sum(size for size, ok in after if ok) == 3


def test_a_draft_pool_that_reports_little_room_is_not_refused_either(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pools, "ROOM_FRESH_S", 600.0)  # reports never age: no round outlives one
    draft = SharedDraft(pool=SharedPool(blocks=10, others=4), reports_room=True)

    async def test(sched: Scheduler) -> None:
        await all_finish(sched, 4)
        assert draft.pool.refusals == 0 and sched.stats.preemptions > 0
        assert sched.stats.speculation_enabled == 1 and sched.stats.draft_failures == 0

    run(test, FakeTarget(), draft)


def test_a_gateway_left_holding_nothing_backs_off_before_trying_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its backoff (1.5-4.5 s with the jitter) is far past the 0.1 s looked at below, even on a
    # loaded machine; the test then waits it out. No word of no room holds it back: it has no
    # response to bring news.
    monkeypatch.setattr(pools, "FIRST_BACKOFF_S", 3.0)
    monkeypatch.setattr(pools, "LAST_BACKOFF_S", 3.0)
    target = SharedTarget(pool=SharedPool(blocks=8), reports_room=True)

    async def test(sched: Scheduler) -> None:
        seq = new_request(request(max_new_tokens=100), policy())
        sched.submit(seq)
        await until(lambda: len(target.verify_batches) >= 2)
        target.pool.others = 8  # another gateway takes the whole pool: the Verify is refused, the request preempted
        await until(lambda: target.pool.refusals >= 1)
        await asyncio.sleep(0.1)
        assert target.pool.refusals == 1 and not seq.done  # waits, neither retrying at once nor failing
        target.pool.others = 0
        tokens, finished = await drain(seq)
        assert finished.reason == FinishReason.LENGTH and tokens == greedy_reference(prompt_ids(), 100)

    run(test, target, FakeDraft())
