"""Which gateway holds which slot, and when a silent gateway's slots expire.

A gateway that dies (kill -9, a lost node) cannot release its slots; without leases they
would stay allocated forever. Each slot-creating call carries a `Lease` (holder =
the gateway instance, incarnation = this start of it), and the gateway renews it every
few seconds. The table answers three questions for the engine:

* `claim` / `renew`: record that a holder is alive; a newer incarnation of a holder
  makes the slots of its older incarnations stale (the gateway restarted: sweep them);
  an older one is refused (two gateways configured with one name).
* `expired`: the slots of holders that have not renewed within the TTL.
* `forget`: a slot was released.

Slots created without a lease (tests, admin tools) belong to nobody and never expire.
Pure bookkeeping: the engine frees the slots this returns. Thread-safe, because renewals
are recorded on the service's event loop at once, not queued behind a running batch on
the model worker: a busy worker must never make a live gateway look silent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from specdec.errors import StaleLeaseError
from specdec.wire.items import Lease


@dataclass
class _Holder:
    incarnation: str
    expires_at: float


class LeaseTable:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._holders: dict[str, _Holder] = {}
        #: Slot id -> the lease it was created under.
        self._owner: dict[str, Lease] = {}
        #: Slots freed because their holder stopped renewing / because it restarted.
        self.expired_slots_total = 0
        self.swept_slots_total = 0
        self._lock = threading.Lock()

    @property
    def num_holders(self) -> int:
        return len(self._holders)

    def held_slots(self) -> int:
        """Slots a holder owns (a gateway's, until it releases them or its lease expires)."""
        with self._lock:
            return len(self._owner)

    def holder_of(self, slot_id: str) -> str | None:
        """The holder of `slot_id` (None: no such slot, or one created without a lease)."""
        with self._lock:
            owner = self._owner.get(slot_id)
            return None if owner is None else owner.holder

    def holders_with_slots(self) -> set[str]:
        """The holders that own at least one slot here."""
        with self._lock:
            return {lease.holder for lease in self._owner.values()}

    def owners(self) -> dict[str, str]:
        """Each leased slot's holder (slots created without a lease are not in it)."""
        with self._lock:
            return {slot_id: lease.holder for slot_id, lease in self._owner.items()}

    def slots_held_with(self, slot_id: str) -> list[str]:
        """Every slot the holder of `slot_id` owns, `slot_id` among them (none for a slot
        created without a lease): what one gateway holds, whatever its calls' batches."""
        with self._lock:
            owner = self._owner.get(slot_id)
            if owner is None:
                return []
            return [slot for slot, lease in self._owner.items() if lease.holder == owner.holder]

    def check(self, lease: Lease | None) -> None:
        """StaleLeaseError when `lease` is an older incarnation than one already seen (no side effects)."""
        if lease is None:
            return
        with self._lock:
            self._check(lease)

    def _check(self, lease: Lease) -> None:
        known = self._holders.get(lease.holder)
        if known is not None and lease.incarnation < known.incarnation:
            raise StaleLeaseError(
                f"lease: incarnation {lease.incarnation!r} of {lease.holder!r} is older than "
                f"{known.incarnation!r}, which holds its slots now"
            )

    def renew(self, lease: Lease) -> list[str]:
        """Extend the holder's lease. Returns the slots of its older incarnations (to free)."""
        with self._lock:
            return self._renew(lease)

    def _renew(self, lease: Lease) -> list[str]:
        self._check(lease)
        known = self._holders.get(lease.holder)
        self._holders[lease.holder] = _Holder(lease.incarnation, self._clock() + self.ttl_s)
        if known is None or known.incarnation == lease.incarnation:
            return []
        stale = [slot for slot, owner in self._owner.items() if owner.holder == lease.holder and owner != lease]
        self.swept_slots_total += len(stale)
        return stale

    def claim(self, slot_ids: Iterable[str], lease: Lease | None) -> list[str]:
        """Record new slots under `lease` (renewing it). Returns stale slots to free, as `renew`."""
        if lease is None:
            return []
        with self._lock:
            stale = self._renew(lease)
            for slot_id in slot_ids:
                self._owner[slot_id] = lease
            return stale

    def forget(self, slot_id: str) -> None:
        with self._lock:
            self._owner.pop(slot_id, None)

    def expired(self) -> list[str]:
        """Drop every holder whose lease ran out; returns their slots (to free)."""
        with self._lock:
            return self._expired()

    def _expired(self) -> list[str]:
        now = self._clock()
        gone = {name for name, holder in self._holders.items() if holder.expires_at <= now}
        if not gone:
            return []
        for name in gone:
            del self._holders[name]
        slots = [slot for slot, owner in self._owner.items() if owner.holder in gone]
        self.expired_slots_total += len(slots)
        return slots
