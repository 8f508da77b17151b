"""Requests that outlive their target (`specdec.gateway.target_outage`): a target that restarts
mid-request costs the request a Prefill of its tokens, not its output; one that never comes
back fails its requests UNAVAILABLE after `RESUME_WITHIN_S`, without the scheduler spinning."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
import pytest

from specdec.gateway.request import FinishReason
from specdec.gateway.scheduler import Scheduler
from specdec.gateway.target_outage import TargetOutage
from specdec.wire.items import PrefillItem, VerifyItem
from tests.support.fakes import FakeDraft, FakeTarget, greedy_reference, policy, rpc_error
from tests.unit.gateway.test_scheduler import drain, generation, new_request, prompt_ids, request, run


@dataclass
class RestartingTarget(FakeTarget):
    """Fails its `restart_at`-th Verify UNAVAILABLE, losing every slot as a restarted process
    does, and refuses Prefills (UNAVAILABLE) for the next `down_prefills` tries."""

    restart_at: int = 3
    down_prefills: int = 0
    verifies: int = 0
    refused_prefills: int = 0

    async def verify(self, items: list[VerifyItem], timeout: float):  # type: ignore[no-untyped-def]
        self.verifies += 1
        if self.verifies == self.restart_at:
            self.slots.clear()
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")
        return await super().verify(items, timeout)

    async def prefill(self, items: list[PrefillItem], timeout: float):  # type: ignore[no-untyped-def]
        if self.verifies >= self.restart_at and self.refused_prefills < self.down_prefills:
            self.refused_prefills += 1
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")
        return await super().prefill(items, timeout)

    async def release(self, slot_id: str, timeout: float) -> None:
        self.slots.setdefault(slot_id, [])  # a restarted target answers NOT_FOUND: let the fake free it
        await super().release(slot_id, timeout)


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("specdec.gateway.target_outage.RETRY_S", 0.02)


@pytest.mark.parametrize("down_prefills", [0, 5])
def test_a_target_restart_costs_the_request_a_prefill_not_its_output(down_prefills: int) -> None:
    target, draft = RestartingTarget(down_prefills=down_prefills), FakeDraft()

    async def test(sched: Scheduler) -> None:
        seq = new_request(request(max_new_tokens=30), policy())
        sched.submit(seq)
        tokens, finished = await drain(seq)
        assert finished.reason == FinishReason.LENGTH
        assert tokens == greedy_reference(prompt_ids(), 30)  # as if nothing had happened
        first, resumed = target.prefills_started[0][0], target.prefills_started[-1][0]
        assert resumed != first and target.prefilled[resumed][:len(prompt_ids())] == prompt_ids()
        assert len(target.prefilled[resumed]) > len(prompt_ids())  # its generated tokens came along
        assert target.refused_prefills == down_prefills and seq.target_lost_at is None
        assert sched.stats.resume_time.count == 1 and sched.stats.resume_time.total > 0  # counted once

    run(test, target, draft)


def test_requests_fail_unavailable_when_the_target_stays_away(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("specdec.gateway.target_outage.RESUME_WITHIN_S", 0.5)
    target, draft = RestartingTarget(restart_at=1, down_prefills=10**6), FakeDraft()

    async def test(sched: Scheduler) -> None:
        seq = new_request(request(max_new_tokens=30), policy())
        sched.submit(seq)
        _, finished = await asyncio.wait_for(drain(seq), 10)
        assert finished.reason == FinishReason.ERROR and generation(seq).error_status == grpc.StatusCode.UNAVAILABLE
        assert "did not come back" in finished.error
        assert target.refused_prefills <= 0.5 / 0.02 + 5  # tried every RETRY_S, not in a busy loop
        assert not sched.waiting and not sched.running

    run(test, target, draft)


def test_a_request_queued_after_its_target_came_back_waits_for_room_not_a_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bound applies while the target is down: once a Prefill succeeded, a request the
    outage left in the queue (waiting for KV room) is not failed for having lost it earlier."""
    monkeypatch.setattr("specdec.gateway.target_outage.RESUME_WITHIN_S", 0.0)
    outage, seq = TargetOutage(), new_request(request(), policy())
    outage.lost([seq], grpc.StatusCode.UNAVAILABLE)
    assert outage.expired([seq]) == [seq]
    outage.answered()
    assert outage.expired([seq]) == []
