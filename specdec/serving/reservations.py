"""The KV blocks each slot has reserved to grow into, and when a new slot must leave them free.

A gateway that reserves its requests' growth (`--reserve-kv-growth`) declares, with each
slot it creates, the most tokens the slot will hold (`max_len`: its prompt, its most new
tokens and one round's draft tokens). The free blocks between what a slot holds now and
that length are its reserved growth; a slot that declares nothing reserves none.

* **A pool one lease holder has to itself** admits on demand: a new slot needs room for its
  prompt alone, and the holder preempts its own newest request when its requests outgrow
  the pool, as one vLLM engine does.
* **A shared pool**, where another holder's slots have growth left or another holder was
  refused room for a new slot within `WAITING_S`: a new slot is given only the free blocks
  beyond every slot's reserved growth (the asking holder's own too), and must fit there at
  its whole length. Gateways sharing a pair then never admit into room that requests
  already running will grow into, which would end in preempting requests as they grow:
  each preemption is a second Prefill of the request's prompt and tokens, on both services.

A refused holder keeps the pool shared while it waits, so the holder that has it cannot
keep filling it on demand: both admit at whole lengths until the waiting one is in.

The target refuses a Prefill that breaks the rule: admission happens there. The draft only
reports its reserved growth (`PoolRoom.reserved_blocks`), which gateways admit within; it
makes a slot after the target's for the same request (its first Propose or KV import), and
refusing it then would preempt a request the target took, over counts that differ by the
services' lags (a finished request's slot goes at one service before the other).
Reservations guard against new slots only; a slot growing past its reservation, or one that
declared none, takes free blocks as before, and the call that cannot get them is refused.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

from specdec.errors import SlotNotFoundError
from specdec.kv_cache.block_manager import BlockManager

#: A holder refused room for a new slot counts as sharing the pool this long (its gateway
#: tries again well within it: `specdec.gateway.pools.LAST_BACKOFF_S`).
WAITING_S = 2.0


class Reservations:
    """Each slot's declared most tokens (capped at the service's `max_seq_len`), and the
    holders refused room lately. Holders are lease holders' names; None stands for the
    callers without a lease, as one holder."""

    def __init__(self, max_seq_len: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_seq_len = max_seq_len
        self._clock = clock
        self._max_len: dict[str, int] = {}
        #: Holder -> when it was last refused room for a new slot.
        self._refused_at: dict[str | None, float] = {}
        self._lock = threading.Lock()  # a metrics scrape reads while the model worker writes

    def reserve(self, slot_id: str, max_len: int) -> None:
        """Record a new slot's declared most tokens (0: it reserves nothing)."""
        if max_len > 0:
            with self._lock:
                self._max_len[slot_id] = min(max_len, self.max_seq_len)

    def forget(self, slot_id: str) -> None:
        with self._lock:
            self._max_len.pop(slot_id, None)

    def refused(self, holder: str | None) -> None:
        """`holder` was refused room for a new slot: the pool counts as shared for `WAITING_S`."""
        with self._lock:
            self._refused_at[holder] = self._clock()

    def admitted(self, holder: str | None) -> None:
        """`holder` was given new slots: it waits no more."""
        with self._lock:
            self._refused_at.pop(holder, None)

    def growth(self, blocks: BlockManager) -> dict[str, int]:
        """Each slot's reserved growth in blocks: those up to its most tokens past those it
        holds (only slots with some left)."""
        with self._lock:
            declared = list(self._max_len.items())
        size = blocks.block_size
        left = {slot_id: -(-max_len // size) - _blocks_of(blocks, slot_id) for slot_id, max_len in declared}
        return {slot_id: n for slot_id, n in left.items() if n > 0}

    def kept_free(self, blocks: BlockManager, holder: str | None, owners: Callable[[], Mapping[str, str]]) -> int:
        """Free blocks a new slot of `holder` may not take: every slot's reserved growth while
        the pool is shared with another holder, none while `holder` has it to itself
        (`owners`: each leased slot's holder, asked for only while some growth is reserved:
        every Verify and Propose response asks, and with no reservation the answer is 0)."""
        growth = self.growth(blocks)
        if not growth:
            return 0
        now = self._clock()
        with self._lock:
            self._refused_at = {h: at for h, at in self._refused_at.items() if now - at < WAITING_S}
            waiting = any(h != holder for h in self._refused_at)
        if waiting:
            return sum(growth.values())
        holders = owners()
        return sum(growth.values()) if any(holders.get(slot_id) != holder for slot_id in growth) else 0


def _blocks_of(blocks: BlockManager, slot_id: str) -> int:
    """The blocks `slot_id` holds; 0 once it is gone (a scrape may read while a slot is freed)."""
    try:
        return len(blocks.block_table(slot_id))
    except SlotNotFoundError:
        return 0
