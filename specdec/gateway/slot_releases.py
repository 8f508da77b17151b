"""Freeing a request's slots in both model services when it finishes, is preempted or loses
its target.

A slot already gone (NOT_FOUND) counts as freed. A Release that fails is tried again in the
background until it succeeds, since a live gateway's lease never lets its slots expire; one
still under way when the scheduler stops is sent again (`pending`), since a drain ends as the
last stream's final message goes out, before that request's Release has returned.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from specdec.gateway.model_clients import DraftAPI, TargetAPI
from specdec.gateway.request import Request
from specdec.serving.serial_executor import cancel_and_wait

log = logging.getLogger(__name__)
#: How often failed Releases are tried again.
RELEASE_RETRY_S = 1.0


class SlotReleases:
    """Releases of `target`'s and `draft`'s slots, each call given `timeout()` seconds."""

    def __init__(self, target: TargetAPI, draft: DraftAPI | None, timeout: Callable[[], float]) -> None:
        self.target, self.draft, self.timeout = target, draft, timeout
        #: Slots whose Release failed (service down or slow), by service name.
        self.unreleased: dict[str, set[str]] = {"target": set(), "draft": set()}
        #: Requests whose Release is under way, by slot id (`pending`).
        self._releasing: dict[str, Request] = {}
        self._retry: asyncio.Task[None] | None = None

    async def release(self, seq: Request) -> None:
        """Free the request's slots in both services."""
        services = ["target"] + (["draft"] if self.draft is not None and seq.has_draft_slot else [])
        self._releasing[seq.slot_id] = seq
        await asyncio.gather(*(self._release_slot(name, seq.slot_id) for name in services))
        self._releasing.pop(seq.slot_id, None)  # not on a cancellation: `pending` has it then

    def pending(self) -> list[Request]:
        """Requests whose Release was under way when its caller was cancelled."""
        return list(self._releasing.values())

    async def stop(self) -> None:
        await cancel_and_wait(self._retry)

    async def _release_slot(self, service: str, slot_id: str) -> bool:
        """True once the slot is gone from `service` (freed now, or not there)."""
        client = self.target if service == "target" else self.draft
        assert client is not None
        try:
            await client.release(slot_id, self.timeout())
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:
                if slot_id not in self.unreleased[service]:
                    log.warning("release of slot %s in the %s failed (%s); retrying in the background",
                                slot_id, service, error.code().name)
                self.unreleased[service].add(slot_id)
                if self._retry is None or self._retry.done():
                    self._retry = asyncio.create_task(self._retry_releases(), name="specdec-release-retry")
                return False
        self.unreleased[service].discard(slot_id)
        return True

    async def _retry_releases(self) -> None:
        while any(self.unreleased.values()):
            await asyncio.sleep(RELEASE_RETRY_S)
            for service, slots in self.unreleased.items():
                for slot_id in list(slots):
                    if await self._release_slot(service, slot_id):
                        log.info("slot %s released from the %s on a retry", slot_id, service)
