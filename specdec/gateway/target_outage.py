"""Requests that outlive their target.

When the target fails a round or an admission in a way a restart explains (UNAVAILABLE: it is
down; NOT_FOUND: it came back without this gateway's slots; DEADLINE_EXCEEDED: it hangs, or is
still loading), its requests keep their tokens at the gateway and wait at the head of the
queue to be prefilled again (prompt and generated tokens, as after a preemption: greedy
output unchanged, a seeded sampled request exact in distribution), on the restarted target or
on whatever answers at its address. Admission tries the target again every `RETRY_S` (at
once when its Info answers again); a request that has waited `RESUME_WITHIN_S` fails
UNAVAILABLE, its message naming the failure that began the outage (e.g. DEADLINE_EXCEEDED
for a hung target), so none waits forever.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeGuard

import grpc

from specdec.gateway.request import Request

#: The longest a request waits for its target to come back: a restarted target loads its
#: model and checks its costs first (tens of seconds on a CPU; a cold GPU start, minutes).
RESUME_WITHIN_S = 120.0
#: How often admission tries a target that is down.
RETRY_S = 1.0
_RESTART_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED})


def explained_by_restart(error: BaseException) -> TypeGuard[grpc.aio.AioRpcError]:
    """Whether the target's failure is one a restart explains (see the module docstring)."""
    return isinstance(error, grpc.aio.AioRpcError) and error.code() in _RESTART_CODES


@dataclass
class TargetOutage:
    """Whether the target is down, and when admission may try it again."""

    down: bool = False
    retry_at: float = 0.0
    #: The status of the failure that began the outage, named by a request that waited too long.
    code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE

    def lost(self, seqs: list[Request], code: grpc.StatusCode) -> None:
        """The target failed these requests with `code`: they note when (the first time), and
        admission waits `RETRY_S` before trying the target again."""
        now = time.monotonic()
        if not self.down:  # the failure that began the outage; retries on a dead target time out
            self.code = code
        self.down, self.retry_at = True, now + RETRY_S
        for seq in seqs:
            if seq.target_lost_at is None:
                seq.target_lost_at = now

    def may_try(self) -> bool:
        return not self.down or time.monotonic() >= self.retry_at

    def answered(self) -> None:
        """A Prefill succeeded: the target is back. Its requests count as resumed only once a
        round of theirs succeeds (`resumed`): a target that takes Prefills but fails every
        round must not reset their wait."""
        self.down = False

    @staticmethod
    def resumed(seqs: list[Request]) -> list[float]:
        """A round of `seqs` succeeded: those that had lost their target are back on one. Returns
        how long each of those was without it (to its first good round)."""
        now, waits = time.monotonic(), []
        for seq in seqs:
            if seq.target_lost_at is not None:
                waits.append(now - seq.target_lost_at)
                seq.target_lost_at = None
        return waits

    def expired(self, waiting: Iterable[Request]) -> list[Request]:
        """While the target is down: the waiting requests that have been without it for
        `RESUME_WITHIN_S`. Once it answers, a request still queued waits for room like any
        other (and nothing is scanned)."""
        if not self.down:
            return []
        deadline = time.monotonic() - RESUME_WITHIN_S
        return [s for s in waiting if s.target_lost_at is not None and s.target_lost_at <= deadline]
