"""The gateway's view of its model services, refreshed in the background.

Every `interval_s` the monitor renews the gateway's lease on each service (so the
service keeps this gateway's slots; see `specdec.serving.leases`), asks it for its Info
with a short deadline and keeps the latest answer: `Gateway.Info` answers from it within milliseconds whatever state
the services are in, the KV-usage metrics come from the services' own counts, and the
gateway's health check reports NOT_SERVING while the target does not answer (SERVING
again once it does). A draft that does not answer only turns speculation off.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

import grpc

from specdec.gateway.model_clients import DraftAPI, TargetAPI
from specdec.gateway.stats import GatewayStats
from specdec.serving.serial_executor import cancel_and_wait
from specdec.wire.model_info import ModelInfo

log = logging.getLogger(__name__)


class ServiceMonitor:
    def __init__(
        self,
        services: Mapping[str, TargetAPI | DraftAPI],
        initial: Mapping[str, ModelInfo],
        stats: GatewayStats,
        interval_s: float = 2.0,
    ) -> None:
        self.services = dict(services)
        #: The latest Info of each service, and whether its last poll was answered in time.
        self.latest: dict[str, ModelInfo] = dict(initial)
        self.available: dict[str, bool] = dict.fromkeys(services, True)
        self.stats = stats
        self.interval_s = interval_s
        #: Called with True / False when the target becomes reachable / unreachable.
        self.on_target: Callable[[bool], Awaitable[None]] | None = None
        #: Called with an Info that differs from the service's last one (it restarted):
        #: returns None once adopted, or why the service is refused (then unavailable).
        self.on_change: Callable[[str, ModelInfo], str | None] | None = None
        #: Called with every Info a poll brings back, and with a service's name when it answers
        #: again after it did not (it may have restarted).
        self.on_info: Callable[[str, ModelInfo], None] | None = None
        self.on_back: Callable[[str], None] | None = None
        #: Why each refused service is refused (logged once per reason).
        self.refused: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None
        for name, info in initial.items():
            self._record_kv(name, info)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="specdec-service-monitor")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        while True:
            await asyncio.gather(*(self.poll(name) for name in self.services))
            await asyncio.sleep(self.interval_s)

    async def poll(self, name: str) -> None:
        info, _ = await asyncio.gather(
            self.services[name].info(timeout=self.interval_s), self._renew(name), return_exceptions=True
        )
        if isinstance(info, (asyncio.TimeoutError, grpc.aio.AioRpcError)):
            await self._set_available(name, False, info)
            return
        if isinstance(info, BaseException):
            raise info
        if self.on_change is not None and _identity(info) != _identity(self.latest[name]):
            reason = self.on_change(name, info)
            if reason is not None:
                if self.refused.get(name) != reason:
                    log.error("the %s service is refused: %s", name, reason)
                self.refused[name] = reason
                await self._set_available(name, False)
                return
            self.refused.pop(name, None)
        self.latest[name] = info
        if self.on_info is not None:
            self.on_info(name, info)
        self._record_kv(name, info)
        await self._set_available(name, True)

    async def _renew(self, name: str) -> None:
        """Renew this gateway's lease; a failure is logged (availability is judged by Info)."""
        try:
            await self.services[name].renew_lease(timeout=self.interval_s)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError) as error:
            if self.available[name]:  # while it is down, its Info failure was logged already
                reason = (f"{error.code().name}: {error.details()}" if isinstance(error, grpc.aio.AioRpcError)
                          else "timeout")
                log.warning("lease renewal with the %s service failed (%s)", name, reason)

    def _record_kv(self, name: str, info: ModelInfo) -> None:
        if info.total_kv_tokens > 0:
            self.stats.kv_usage[name] = 1.0 - info.free_kv_tokens / info.total_kv_tokens
        if name == "target":
            self.stats.target_cache = cache_config(info)

    async def _set_available(self, name: str, available: bool, error: BaseException | None = None) -> None:
        if self.available[name] == available:
            return
        self.available[name] = available
        if available:
            log.info("the %s service answers again", name)
            if self.on_back is not None:
                self.on_back(name)
        else:
            if name not in self.refused:
                reason = (f"{error.code().name}: {error.details()}" if isinstance(error, grpc.aio.AioRpcError)
                          else "no answer in time")
                log.warning("the %s service does not answer its Info (%s)", name, reason)
        if name == "target" and self.on_target is not None:
            await self.on_target(available)


def _identity(info: ModelInfo) -> tuple[object, ...]:
    """What a service's Info says about the service itself, as opposed to its current load."""
    return (
        info.model_id, info.model_name, info.tokenizer, info.max_seq_len, info.block_size, info.total_kv_tokens,
        info.max_slots, info.max_speculative_tokens, info.dtype, info.device, info.quantization, info.forward_costs,
        info.kv_layout,
    )


def cache_config(info: ModelInfo) -> dict[str, str]:
    """The service's KV pool in the labels of vLLM's `cache_config_info` that routers read
    (`num_gpu_blocks` × `block_size` = the pool's tokens, whatever the device)."""
    blocks = info.total_kv_tokens // info.block_size if info.block_size else 0
    return {"block_size": str(info.block_size), "num_gpu_blocks": str(blocks),
            "kv_cache_size_tokens": str(info.total_kv_tokens), "cache_dtype": info.dtype, "device": info.device}
