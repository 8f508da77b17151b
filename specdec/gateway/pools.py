"""The model services' KV pools and slot tables, as a gateway admits against them.

A gateway counts its own requests against each pool (`PoolLimits`, `Scheduler._fits`), but
gateways on one target/draft pair cannot see each other's requests. A service checks every call
against its real free blocks and slots and, when they fall short, refuses the call whole
(RESOURCE_EXHAUSTED with the `CAPACITY_TRAILER`; see `specdec.errors`) and changes
nothing. The gateway then loses no request:

* a refused **Prefill**: its requests go back to the head of the queue (no slot was made);
* a refused **Verify**: its newest requests are preempted (slots freed, resumed later from
  their tokens, as for its own pools) down to one fewer than it ran;
* a refused **Propose**: the round decodes plainly (the target had room), and the newest
  requests are preempted the same way, to give the draft's pool room.

Each refusal lowers the gateway's own batch limit to what it held after that step, so it
does not admit straight back into the pool that just refused it. The limit rises by one
every `PROBE_S` without a refusal, so a gateway learns when the others have left (a limit
learned from refusals alone would keep its first mistake). A gateway that holds nothing
and is refused a Prefill waits an exponential, jittered backoff before trying again: it
has no release of its own to wait for. Every change is logged and counted
(`num_pool_refusals`, `admission_limit`).
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

log = logging.getLogger(__name__)
#: A lowered batch limit rises by one after this long without a refusal.
PROBE_S = 2.0
#: Backoff of a gateway that holds nothing and is refused: from the first to the last, doubling.
FIRST_BACKOFF_S = 0.05
LAST_BACKOFF_S = 1.0


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

    def refused(self, service: str, call: str, holding: int) -> None:
        """`service` refused `call` for room while the gateway held `holding` requests there:
        the limit drops to `holding - 1` after a Verify or Propose (those requests are
        preempted), to `holding` after a Prefill, and never below one."""
        self.stats.pool_refusals[service] += 1
        limit = max(1, holding if call == "Prefill" else holding - 1)
        if holding == 0 or (holding == 1 and call == "Verify"):
            self._backoff_s = min(LAST_BACKOFF_S, max(FIRST_BACKOFF_S, 2 * self._backoff_s))
            self._retry_at = self.clock() + self._backoff_s * random.uniform(0.5, 1.5)
        # INFO, not WARNING: gateways sharing a pair meet this in normal operation (the counter alerts).
        log.info("the %s refused a %s for room (shared with other gateways): admission limit %d -> %d",
                 service, call, self.limit, min(limit, self.limit))
        self.limit = self.stats.admission_limit = min(limit, self.limit)
        self._last_change = self.clock()

    def current_limit(self) -> int:
        """The batch limit now: one higher for every `PROBE_S` without a refusal."""
        steps = int((self.clock() - self._last_change) // PROBE_S)
        if self.limit < self.max_batch_size and steps > 0:
            self.limit = self.stats.admission_limit = min(self.max_batch_size, self.limit + steps)
            self._last_change += steps * PROBE_S
            log.info("no refusal for room in %.1f s: admission limit raised to %d", steps * PROBE_S, self.limit)
        return self.limit

    def may_try(self) -> bool:
        """Whether a Prefill may be sent now (not within a backoff)."""
        return self.clock() >= self._retry_at

    def wait_s(self) -> float:
        """Seconds left of the backoff (0 when none)."""
        return max(0.0, self._retry_at - self.clock())

    def admitted(self) -> None:
        """A Prefill succeeded: the next backoff starts from the first again."""
        self._backoff_s = 0.0
