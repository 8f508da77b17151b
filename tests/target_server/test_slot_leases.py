"""Leases on the target service: slots expire when their gateway goes silent, never while it renews."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import pytest

from specdec.v1 import common_pb2, target_pb2
from tests.support.services import Service, StartService, eventually

LEASE = common_pb2.Lease(holder="gw", incarnation="0001")


def _prefill(target: Service, slot_id: str, lease: common_pb2.Lease = LEASE) -> None:
    item = target_pb2.PrefillItem(slot_id=slot_id, prompt_tokens=[1, 2, 3])
    target.stub.Prefill(target_pb2.PrefillRequest(items=[item], lease=lease))


def _renew(target: Service, lease: common_pb2.Lease = LEASE, timeout: float = 10.0) -> common_pb2.RenewLeaseResponse:
    return target.stub.RenewLease(common_pb2.RenewLeaseRequest(lease=lease), timeout=timeout)


def test_renewals_during_a_long_batch_keep_the_slots(
    start_target: StartService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker is busy for 2.5 TTLs; renewals answered meanwhile (on the event loop) keep the lease."""
    target = start_target(lease_ttl_s=2.0)
    _prefill(target, "kept")
    release = threading.Event()
    real_verify = target.engine.verify

    def stalled_verify(*args: Any) -> object:
        release.wait(timeout=60)
        return real_verify(*args)

    monkeypatch.setattr(target.engine, "verify", stalled_verify)
    item = target_pb2.VerifyItem(slot_id="kept", valid_len=3, tokens=[4])
    pending = target.stub.Verify.future(target_pb2.VerifyRequest(items=[item]), timeout=120)
    started = time.monotonic()
    while time.monotonic() - started < 5.0:
        time.sleep(0.3)
        # Answered although the worker is stuck (until `release`, up to a minute): a renewal queued
        # behind the batch would miss this deadline.
        assert _renew(target, timeout=20).ttl_s == 2.0
    release.set()  # right after a renewal: the slot has a whole TTL for the batch to finish
    # The expiry checks queued behind the batch run now, and see the renewals recorded meanwhile.
    assert pending.result(timeout=30).results[0].cached_len == 4
    assert "kept" in target.engine.tokens and target.engine.leases.expired_slots_total == 0
    # Silent from here on: the slot goes after the TTL and one check.
    assert eventually(lambda: "kept" not in target.engine.tokens), "the silent holder's slot never expired"
    assert target.engine.leases.expired_slots_total == 1


def test_an_older_incarnation_is_refused_and_a_newer_one_sweeps(start_target: StartService) -> None:
    target = start_target(lease_ttl_s=60.0)
    _prefill(target, "old")
    newer = common_pb2.Lease(holder="gw", incarnation="0002")
    assert _renew(target, newer).swept_slots == 1
    assert "old" not in target.engine.tokens
    with pytest.raises(grpc.RpcError) as error:
        _prefill(target, "late", LEASE)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "older" in error.value.details()
    assert "late" not in target.engine.tokens
    with pytest.raises(grpc.RpcError) as error:
        target.stub.RenewLease(common_pb2.RenewLeaseRequest())
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
