"""The model services' KV pools and slot tables, as a gateway admits against them.

A gateway counts its own requests against each pool (`PoolLimits`, `Scheduler._fits`), but
gateways on one target/draft pair cannot see each other's requests. Every Prefill, Verify
and Propose response says what room the service has left (`PoolRoom`): its free blocks and
slots, and those this gateway's lease holds. While that word is fresh (`ROOM_FRESH_S`) the
gateway may hold in a pool what it holds there plus what is free, and no more (`PoolRooms`):
admission waits and the check before a round preempts against that, not against the whole
pool. Word older than that is dropped, so a gateway that has sent nothing for a while is
not shut out on old news; it admits against the whole pool and lets a refusal correct it.

With `--reserve-kv-growth`, each slot declares the most tokens it will hold
(`Request.declared_len`). While another gateway shares a pool, the target then gives a new
slot only the free blocks beyond every slot's reserved growth, and each service says how
many those are (`PoolRoom.reserved_blocks`; the rule is `specdec.serving.reservations`).
A gateway admits a request only when its whole length fits there (`PoolRooms.reserves`), so
that no request is admitted into room that requests already running will grow into:
growing, they would preempt it or be preempted. A gateway alone is told of no reservation
and admits on demand; so do gateways that declare nothing (the default, measured faster:
docs/deployment.md#shared-pools).

A service checks every call against its real free blocks and slots and, when they fall
short, refuses the call whole (RESOURCE_EXHAUSTED with the `CAPACITY_TRAILER`; see
`specdec.errors`) and changes nothing. The gateway then loses no request:

* a refused **Prefill**: its requests go back to the head of the queue (no slot was made);
* a refused **Verify**: its newest requests are preempted (slots freed, resumed later from
  their tokens, as for its own pools) down to one fewer than it ran;
* a refused **Propose**: the round decodes plainly (the target had room), and the newest
  requests are preempted the same way, to give the draft's pool room.

After a refusal the pool counts as full (none free, held what the gateway keeps there)
until the service's next response; a gateway left holding nothing has no response to wait
for and tries again after its backoff. A service that reports its room needs nothing more:
the next response says exactly how much room there is, and a batch limit learned from the
refusal would leave that room unused. For a service from before the report, each refusal
lowers the gateway's own batch limit to what it held after that step, so it does not admit
straight back into the pool that just refused it; the limit rises by one every `PROBE_S`
without a refusal, so a gateway learns when the others have left (a limit learned from
refusals alone would keep its first mistake). A gateway that holds nothing and is refused
waits an exponential, jittered backoff before trying again: it has no release of its own
to wait for. It tries with one request, the head of its queue, until one is admitted.
Every change is logged and counted (`num_pool_refusals`, `admission_limit`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from specdec.errors import CAPACITY_TRAILER
from specdec.gateway.request import Request
from specdec.gateway.stats import GatewayStats
from specdec.wire.model_info import PoolRoom

log = logging.getLogger(__name__)
#: A lowered batch limit rises by one after this long without a refusal.
PROBE_S = 2.0
#: Backoff of a gateway that holds nothing and is refused: from the first to the last, doubling.
#: Short: a refused Prefill costs the service a check, and room another gateway frees is
#: otherwise left idle until the next try.
FIRST_BACKOFF_S = 0.05
LAST_BACKOFF_S = 0.25
#: A service's word on its room counts this long: other gateways' requests come and go
#: within it, and a gateway that has sent nothing for longer must not stay shut out.
ROOM_FRESH_S = 1.0


@dataclass(frozen=True)
class PoolLimits:
    """What one model service can hold, read from its Info at start-up."""

    name: str
    total_kv_tokens: int
    block_size: int
    max_slots: int

    @property
    def num_blocks(self) -> int:
        return self.total_kv_tokens // self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


def kv_tokens_for_round(seq: Request, max_seq_len: int, decode_steps: int = 1) -> int:
    """Most KV tokens the request holds in either service after its next round: its
    tokens, the K draft tokens verified after them (or all but the last of a multi-step
    round's tokens), and the token that round emits."""
    return min(len(seq.tokens) + max(seq.num_speculative_tokens, decode_steps - 1) + 1, max_seq_len)


def round_blocks(pool: PoolLimits, seqs: list[Request], max_seq_len: int, decode_steps: int) -> int:
    """Blocks `seqs` hold in `pool` after their next round, each counted whole (a shared
    prefix as often as it is used: an upper bound)."""
    return sum(pool.blocks_for(kv_tokens_for_round(s, max_seq_len, decode_steps)) for s in seqs)


def refused_for_room(error: BaseException) -> bool:
    """Whether `error` is a model service's retryable refusal for want of KV blocks or slots
    (not, say, gRPC's own RESOURCE_EXHAUSTED for a message over its size limit)."""
    if not isinstance(error, grpc.aio.AioRpcError) or error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    return any(key == CAPACITY_TRAILER for key, _ in error.trailing_metadata() or ())


@dataclass
class PoolContention:
    """The gateway's batch limit while shared pools refuse it room, and its backoff; both
    shown in `stats` (`pool_refusals`, `admission_limit`)."""

    max_batch_size: int
    stats: GatewayStats
    clock: Callable[[], float] = time.monotonic
    limit: int = field(init=False)
    _last_change: float = 0.0
    _retry_at: float = 0.0
    _backoff_s: float = 0.0

    def __post_init__(self) -> None:
        self.limit = self.stats.admission_limit = self.max_batch_size

    def refused(self, service: str, call: str, holding: int, *, room_reported: bool = False) -> None:
        """`service` refused `call` for room while the gateway held `holding` requests there:
        the limit drops to `holding - 1` after a Verify or Propose (those requests are
        preempted), to `holding` after a Prefill, and never below one; it stays as it is
        when the service reports its room (`PoolRooms` keeps the gateway within that)."""
        self.stats.pool_refusals[service] += 1
        if holding == 0 or (holding == 1 and call == "Verify"):
            self._backoff_s = min(LAST_BACKOFF_S, max(FIRST_BACKOFF_S, 2 * self._backoff_s))
            self._retry_at = self.clock() + self._backoff_s * random.uniform(0.5, 1.5)
        # INFO, not WARNING: gateways sharing a pair meet this in normal operation (the counter alerts).
        if room_reported:
            log.info("the %s refused a %s for room (shared with other gateways): the gateway keeps to what it "
                     "holds there until the %s's next response", service, call, service)
            return
        limit = min(self.limit, max(1, holding if call == "Prefill" else holding - 1))
        log.info("the %s refused a %s for room (shared with other gateways): admission limit %d -> %d",
                 service, call, self.limit, limit)
        self.limit = self.stats.admission_limit = limit
        self._last_change = self.clock()

    def current_limit(self) -> int:
        """The batch limit now: one higher for every `PROBE_S` without a refusal."""
        steps = int((self.clock() - self._last_change) // PROBE_S)
        if self.limit < self.max_batch_size and steps > 0:
            self.limit = self.stats.admission_limit = min(self.max_batch_size, self.limit + steps)
            self._last_change += steps * PROBE_S
            log.info("no refusal for room in %.1f s: admission limit raised to %d", steps * PROBE_S, self.limit)
        return self.limit

    def lift(self) -> None:
        """Every service reports its room now: the limit goes back to the batch size (the
        reports keep the gateway within the pools from here on)."""
        if self.limit < self.max_batch_size:
            log.info("every model service reports its room: admission limit %d -> %d", self.limit, self.max_batch_size)
            self.limit = self.stats.admission_limit = self.max_batch_size

    @property
    def probing(self) -> bool:
        """Refused holding nothing, and not admitted since: the next Prefill carries one request,
        which a pool with any room takes (the gateway then hears of the room with every round)."""
        return self._backoff_s > 0

    def may_try(self) -> bool:
        """Whether a Prefill may be sent now (not within a backoff)."""
        return self.clock() >= self._retry_at

    def wait_s(self) -> float:
        """Seconds left of the backoff (0 when none)."""
        return max(0.0, self._retry_at - self.clock())

    def admitted(self) -> None:
        """A Prefill succeeded: the next backoff starts from the first again."""
        self._backoff_s = 0.0


@dataclass(frozen=True)
class RoomView:
    """A service's room as it last reported it to this gateway, and when (`time.monotonic`)."""

    room: PoolRoom
    at: float


@dataclass
class PoolRooms:
    """The room each model service last reported: while fresh, what the gateway may hold in
    its pool (`capacity`); after a refusal, none beyond what the gateway keeps there."""

    clock: Callable[[], float] = time.monotonic
    #: Services that report their room (since the gateway last adopted their Info).
    reporting: set[str] = field(default_factory=set)
    _views: dict[str, RoomView] = field(default_factory=dict)
    #: Services whose last report showed blocks or slots held by others (logged when it changes).
    _shared: set[str] = field(default_factory=set)

    def seen(self, pool: PoolLimits, room: PoolRoom | None) -> None:
        """A response of `pool`'s service reported `room` (None: no report, or no call)."""
        if room is None:
            return
        if pool.name not in self.reporting:
            self.reporting.add(pool.name)
            log.info("the %s reports its room with every call: admission keeps within it", pool.name)
        self._views[pool.name] = RoomView(room, self.clock())
        others = pool.num_blocks - room.held_blocks - room.free_blocks
        shared = others > 0 or pool.max_slots - room.held_slots - room.free_slots > 0
        if shared != (pool.name in self._shared):
            self._shared.symmetric_difference_update({pool.name})
            log.info("the %s's pool is %s", pool.name, f"shared: {others} of {pool.num_blocks} blocks held by "
                     "others" if shared else "no longer shared: no other holder has any of it")

    def refused(self, service: str, held_blocks: int, held_slots: int) -> bool:
        """`service` refused a call for room: until its next response, the gateway may hold
        there only what it keeps (`held_blocks` and `held_slots`); keeping nothing, it has no
        response to wait for, and its word is dropped (its backoff paces it). Returns whether
        the service reports its room (False: one from before the report, which the batch
        limit covers)."""
        if service not in self.reporting:
            return False
        if held_slots:
            self._views[service] = RoomView(PoolRoom(0, 0, held_blocks, held_slots), self.clock())
        else:
            self._views.pop(service, None)
        return True

    def capacity(self, pool: PoolLimits) -> tuple[int, int]:
        """The blocks and slots the gateway may hold in `pool`: what it holds and what is free
        there by the service's fresh word, within the pool; the whole pool without one."""
        view = self._fresh(pool.name)
        if view is None:
            return pool.num_blocks, pool.max_slots
        room = view.room
        return (min(pool.num_blocks, room.held_blocks + room.free_blocks),
                min(pool.max_slots, room.held_slots + room.free_slots))

    def fits(self, pools: list[PoolLimits], seqs: list[Request], headroom: int, max_seq_len: int,
             decode_steps: int) -> bool:
        """Whether every pool holds the next round of all `seqs` and `headroom` spare blocks
        within what the gateway may hold there (`capacity`)."""
        for pool in pools:
            blocks, slots = self.capacity(pool)
            if len(seqs) > slots or round_blocks(pool, seqs, max_seq_len, decode_steps) + headroom > blocks:
                return False
        return True

    def reserves(self, pools: list[PoolLimits], newcomers: list[Request], max_seq_len: int) -> bool:
        """Whether every pool whose service's fresh word shows reserved growth (a shared pool)
        holds `newcomers` at their whole length in the free blocks beyond it."""
        for pool in pools:
            view = self._fresh(pool.name)
            if view is None or not view.room.reserved_blocks:
                continue
            whole = sum(pool.blocks_for(min(seq.max_len, max_seq_len)) for seq in newcomers)
            if whole > view.room.free_blocks - view.room.reserved_blocks:
                return False
        return True

    def _fresh(self, service: str) -> RoomView | None:
        """The service's word on its room while fresh; None once it has aged (it is dropped)."""
        view = self._views.get(service)
        if view is not None and self.clock() - view.at > ROOM_FRESH_S:
            del self._views[service]
            log.info("no word of the %s's room for %.1f s: admitting against its whole pool until the next",
                     service, ROOM_FRESH_S)
            return None
        return view

    def fresh_for_s(self) -> float:
        """Seconds until the youngest word on a room ages out (0 when none is fresh)."""
        now = self.clock()
        return max([ROOM_FRESH_S - (now - view.at) for view in self._views.values()] + [0.0])

    def forget(self, service: str) -> None:
        """The service came back with another pool: its room, and whether it reports one, are unknown."""
        self._views.pop(service, None)
        self.reporting.discard(service)
        self._shared.discard(service)
