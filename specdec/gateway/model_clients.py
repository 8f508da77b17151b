"""Async clients of the target and draft services, speaking domain types.

The gateway's scheduler calls these through the `TargetAPI` and `DraftAPI` protocols (so
its unit tests can run it against fakes); the gRPC clients here only convert domain
types to protobuf and back, with the conversions of `specdec.wire.items`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Generic, Protocol, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.gateway.streamed_rpc import StreamedRpc
from specdec.serving.security import bearer_token_interceptors
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specdec.wire.items import (
    Lease,
    PrefillItem,
    Proposal,
    ProposeItem,
    ScoredChunk,
    VerifiedChunk,
    VerifyItem,
    verified_from_pb,
)
from specdec.wire.keepalive import client_keepalive_options, client_reconnect_options
from specdec.wire.kv_transfer import ImportHeader, KVExport
from specdec.wire.limits import message_size_options
from specdec.wire.model_info import ModelInfo, PoolRoom

T = TypeVar("T")
#: How long start-up waits for a service's first Info (it may still be loading its model).
INFO_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Timed(Generic[T]):
    """A model service's reply with its two costs: compute on the service, and the call's
    wall time as the gateway saw it (compute + queueing + (de)serialisation + transport);
    the service's room after the call (None: it reports none, a service before the field);
    the items of the forward that answered it, other gateways' merged calls included (0: not
    reported); and the seconds the call waited at the service for that forward to begin
    (part of `wall_s`; 0: not reported)."""

    value: T
    compute_s: float
    wall_s: float
    room: PoolRoom | None = None
    run_items: int = 0
    queued_s: float = 0.0

    def costs(self) -> Timed[None]:
        """The reply's costs without its value (what a round's report keeps)."""
        return Timed(None, self.compute_s, self.wall_s, self.room, self.run_items, self.queued_s)


class TargetAPI(Protocol):
    """What the scheduler needs from the target service."""

    async def info(self, timeout: float = INFO_TIMEOUT_S) -> ModelInfo: ...
    async def serving(self, timeout: float) -> bool: ...
    async def renew_lease(self, timeout: float) -> int: ...
    async def prefill(self, items: list[PrefillItem], timeout: float) -> Timed[dict[str, ScoredChunk]]: ...
    async def verify(self, items: list[VerifyItem], timeout: float) -> Timed[dict[str, VerifiedChunk]]: ...
    async def export_kv(self, export: KVExport, timeout: float) -> list[common_pb2.KVPiece]: ...
    async def release(self, slot_id: str, timeout: float) -> None: ...
    async def close(self) -> None: ...


class DraftAPI(Protocol):
    """What the scheduler needs from the draft service."""

    async def info(self, timeout: float = INFO_TIMEOUT_S) -> ModelInfo: ...
    async def serving(self, timeout: float) -> bool: ...
    async def renew_lease(self, timeout: float) -> int: ...
    async def propose(self, items: list[ProposeItem], timeout: float) -> Timed[dict[str, Proposal]]: ...
    async def import_kv(self, header: ImportHeader, pieces: list[common_pb2.KVPiece], timeout: float) -> Timed[int]: ...
    async def release(self, slot_id: str, timeout: float) -> None: ...
    async def close(self) -> None: ...


@dataclass(frozen=True)
class ServiceLink:
    """How the gateway's channels reach the model services: message limit, TLS, token."""

    max_message_bytes: int
    #: TLS (mutual when it holds the gateway's certificate); None for plaintext.
    credentials: grpc.ChannelCredentials | None = None
    #: Bearer token sent with every call ("" for none).
    token: str = ""
    #: Propose and Verify as exchanges on one kept stream per service (`StreamedRpc`)
    #: rather than a unary call each.
    streamed: bool = True
    #: Seconds between keepalive pings on each connection (0: none), and how long one may
    #: go unanswered (`specdec.wire.keepalive`).
    keepalive_s: float = 0.0
    keepalive_timeout_s: float = 5.0

    def channel(self, address: str) -> grpc.aio.Channel:
        options = (message_size_options(self.max_message_bytes) + client_reconnect_options()
                   + client_keepalive_options(self.keepalive_s, self.keepalive_timeout_s))
        interceptors = bearer_token_interceptors(self.token) if self.token else None
        if self.credentials is not None:
            return grpc.aio.secure_channel(address, self.credentials, options=options, interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


Stub = TypeVar("Stub", target_pb2_grpc.TargetServiceStub, draft_pb2_grpc.DraftServiceStub)


class _ServiceClient(Generic[Stub]):
    """Info, health, Release and the lease: what both clients share.

    Every slot this client creates is held under `lease`, which `renew_lease` keeps alive.
    """

    def __init__(
        self, address: str, link: ServiceLink, stub_cls: Callable[[grpc.aio.Channel], Stub], lease: Lease
    ) -> None:
        self.lease = lease
        self.channel = link.channel(address)
        self.stub: Stub = stub_cls(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def info(self, timeout: float = INFO_TIMEOUT_S) -> ModelInfo:
        """Waits for the service to come up (start-up) within `timeout`."""
        return ModelInfo.from_pb(await self.stub.Info(common_pb2.InfoRequest(), wait_for_ready=True, timeout=timeout))

    async def serving(self, timeout: float) -> bool:
        """The standard health check; False when it says otherwise or does not answer in time."""
        try:
            reply = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    async def renew_lease(self, timeout: float) -> int:
        """Keep this gateway's slots alive; returns how many slots of its previous incarnation were freed."""
        request = common_pb2.RenewLeaseRequest(lease=self.lease.to_pb())
        return int((await self.stub.RenewLease(request, timeout=timeout)).swept_slots)

    async def release(self, slot_id: str, timeout: float) -> None:
        await self.stub.Release(common_pb2.ReleaseRequest(slot_id=slot_id), timeout=timeout)

    async def close(self) -> None:
        await self.channel.close()


class TargetClient(_ServiceClient[target_pb2_grpc.TargetServiceStub]):
    def __init__(self, address: str, link: ServiceLink, lease: Lease) -> None:
        super().__init__(address, link, target_pb2_grpc.TargetServiceStub, lease)
        self._verify: Callable[[target_pb2.VerifyRequest, float], Awaitable[target_pb2.VerifyResponse]] = (
            StreamedRpc(self.stub.VerifyStream, self._verify_unary) if link.streamed else self._verify_unary
        )

    async def _verify_unary(self, request: target_pb2.VerifyRequest, timeout: float) -> target_pb2.VerifyResponse:
        return await self.stub.Verify(request, timeout=timeout)

    async def prefill(self, items: list[PrefillItem], timeout: float) -> Timed[dict[str, ScoredChunk]]:
        """Last-position logits [vocab] per slot."""
        started = time.perf_counter()
        # wait_for_ready: right after a target restart the channel is in reconnect backoff;
        # a new request waits for it (within its deadline) instead of failing at once.
        request = target_pb2.PrefillRequest(items=[item.to_pb() for item in items], lease=self.lease.to_pb())
        response = await self.stub.Prefill(request, timeout=timeout, wait_for_ready=True)
        results = {r.slot_id: ScoredChunk.from_pb(r) for r in response.results}
        return Timed(results, response.compute_s, time.perf_counter() - started, PoolRoom.of(response))

    async def verify(self, items: list[VerifyItem], timeout: float) -> Timed[dict[str, VerifiedChunk]]:
        """The answer of each item's mode, per slot."""
        started = time.perf_counter()
        request = target_pb2.VerifyRequest(items=[item.to_pb() for item in items], timeout_s=timeout)
        response = await self._verify(request, timeout)
        results = {r.slot_id: verified_from_pb(r) for r in response.results}
        return Timed(results, response.compute_s, time.perf_counter() - started, PoolRoom.of(response),
                     response.run_items, response.queued_s)

    async def export_kv(self, export: KVExport, timeout: float) -> list[common_pb2.KVPiece]:
        """The keys and values of `export`, every piece the target sends. Received whole before
        the import starts: an export that fails then fails here, with its own status, and no
        import is left waiting on it."""
        return [piece async for piece in self.stub.ExportKV(export.to_pb(), timeout=timeout)]


class DraftClient(_ServiceClient[draft_pb2_grpc.DraftServiceStub]):
    def __init__(self, address: str, link: ServiceLink, probs_dtype: common_pb2.DType, lease: Lease) -> None:
        super().__init__(address, link, draft_pb2_grpc.DraftServiceStub, lease)
        self.probs_dtype = probs_dtype
        self._propose: Callable[[draft_pb2.ProposeRequest, float], Awaitable[draft_pb2.ProposeResponse]] = (
            StreamedRpc(self.stub.ProposeStream, self._propose_unary) if link.streamed else self._propose_unary
        )

    async def _propose_unary(self, request: draft_pb2.ProposeRequest, timeout: float) -> draft_pb2.ProposeResponse:
        return await self.stub.Propose(request, timeout=timeout)

    async def propose(self, items: list[ProposeItem], timeout: float) -> Timed[dict[str, Proposal]]:
        """The K drafted tokens per slot, with q in the wire dtype exactly as the draft sent it."""
        started = time.perf_counter()
        request = draft_pb2.ProposeRequest(
            items=[item.to_pb() for item in items], probs_dtype=self.probs_dtype, lease=self.lease.to_pb()
        )
        response = await self._propose(request, timeout)
        results = {r.slot_id: Proposal.from_pb(r) for r in response.results}
        return Timed(results, response.compute_s, time.perf_counter() - started, PoolRoom.of(response),
                     response.run_items, response.queued_s)

    async def import_kv(self, header: ImportHeader, pieces: list[common_pb2.KVPiece], timeout: float) -> Timed[int]:
        """Import `pieces` into the slot `header` names, a new one held under this client's
        lease; returns the slot's cached length after it."""
        started = time.perf_counter()
        requests = [replace(header, lease=self.lease).to_pb(),
                    *(draft_pb2.ImportKVRequest(piece=piece) for piece in pieces)]
        response = await self.stub.ImportKV(iter(requests), timeout=timeout)
        return Timed(response.cached_len, response.compute_s, time.perf_counter() - started)
