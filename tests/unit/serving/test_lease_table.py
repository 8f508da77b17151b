"""The lease table: expiry after the TTL, sweeping a restarted holder, refusing an older incarnation."""

from __future__ import annotations

import pytest

from specdec.errors import StaleLeaseError
from specdec.serving.leases import LeaseTable
from specdec.wire.items import Lease


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_slots_of_a_silent_holder_expire_after_the_ttl_and_renewals_keep_them() -> None:
    clock = Clock()
    table = LeaseTable(ttl_s=5.0, clock=clock)
    a, b = Lease("gw-a", "1"), Lease("gw-b", "1")
    assert table.claim(["a1", "a2"], a) == [] and table.claim(["b1"], b) == []
    clock.now += 4.0
    table.renew(b)
    assert table.expired() == []
    clock.now += 1.5  # a: 5.5 s since its last call; b renewed 1.5 s ago
    assert sorted(table.expired()) == ["a1", "a2"]
    assert table.expired_slots_total == 2 and table.num_holders == 1
    for slot in ("a1", "a2"):
        table.forget(slot)
    clock.now += 10.0
    assert table.expired() == ["b1"]
    assert table.expired_slots_total == 3


def test_a_new_incarnation_sweeps_the_old_ones_slots_and_the_old_one_is_refused() -> None:
    table = LeaseTable(ttl_s=30.0, clock=Clock())
    old, new = Lease("gw", "0001"), Lease("gw", "0002")
    table.claim(["s1", "s2"], old)
    table.claim(["other"], Lease("gw-2", "0001"))
    assert sorted(table.renew(new)) == ["s1", "s2"]  # only this holder's, only the old incarnation's
    assert table.swept_slots_total == 2
    for slot in ("s1", "s2"):
        table.forget(slot)
    assert table.claim(["s3"], new) == []  # the current incarnation's own slots are never swept
    with pytest.raises(StaleLeaseError, match="older"):
        table.check(old)
    with pytest.raises(StaleLeaseError):
        table.renew(old)


def test_slots_without_a_lease_never_expire() -> None:
    clock = Clock()
    table = LeaseTable(ttl_s=1.0, clock=clock)
    assert table.claim(["mine"], None) == []
    clock.now += 1000
    assert table.expired() == [] and table.num_holders == 0


def test_the_slots_held_with_a_slot_are_its_holders() -> None:
    table = LeaseTable(ttl_s=30.0, clock=Clock())
    table.claim(["a1", "a2"], Lease("gw-a", "1"))
    table.claim(["b1"], Lease("gw-b", "1"))
    table.claim(["nobody"], None)
    assert sorted(table.slots_held_with("a2")) == ["a1", "a2"] and table.slots_held_with("b1") == ["b1"]
    assert table.slots_held_with("nobody") == [] and table.slots_held_with("gone") == []
