"""The target gRPC servicer: protobuf in, engine call on the model worker, protobuf out (encoded
on the worker too: the event loop only sends it)."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import AsyncIterator, Hashable, Sequence
from dataclasses import dataclass

import grpc

from specdec.errors import InvalidArgumentError
from specdec.serving.call_merger import CallMerger, split, stamped
from specdec.serving.errors import grpc_errors, grpc_stream_errors
from specdec.serving.grpc_server import RunningServer
from specdec.serving.metrics import ServiceStats
from specdec.serving.model_service import SlotServicer, start_model_service
from specdec.serving.serial_executor import SerialExecutor
from specdec.target_server.config import TargetConfig
from specdec.target_server.engine import TargetEngine
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from specdec.wire.items import Lease, PrefillItem, ScoredChunk, VerifiedChunk, VerifyItem, verified_to_pb
from specdec.wire.kv_transfer import split_pieces
from specdec.wire.model_info import PoolRoom
from specdec.wire.tensor_codec import torch_dtype

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name
#: A gateway that misses a Verify hold is not waited for during one hold, never more: every
#: gateway with slots here verifies every round, so one that misses is late (a Prefill, a
#: catch-up), not absent, and a longer back-off lets two gateways settle into turns
#: (docs/deployment.md#shared-pools).
VERIFY_BACKOFF_HOLDS = (1, 1)


@dataclass(frozen=True)
class VerifyCall:
    """One Verify's requests, as the call merger runs them: `deadline` a `time.monotonic` instant."""

    items: list[VerifyItem]
    deadline: float | None
    holder: str | None
    key: Hashable = None

    @property
    def rows(self) -> int:
        return len(self.items)

    @property
    def tokens(self) -> int:
        return sum(len(item.tokens) for item in self.items)


def verify_together(engine: TargetEngine, calls: Sequence[VerifyCall]) -> list[list[VerifiedChunk]]:
    """Several Verify calls in one engine call; decode steps stop at the earliest deadline."""
    deadlines = [call.deadline for call in calls if call.deadline is not None]
    results = engine.verify([item for call in calls for item in call.items], min(deadlines, default=None))
    return split(results, [len(call.items) for call in calls])


class TargetServicer(SlotServicer, target_pb2_grpc.TargetServiceServicer):
    """Prefill, Verify and ExportKV; Info, Truncate and Release come from `SlotServicer`.
    Verify calls from several gateways run merged (`specdec.serving.call_merger`)."""

    engine: TargetEngine

    def __init__(self, engine: TargetEngine, worker: SerialExecutor, stats: ServiceStats) -> None:
        super().__init__(engine, worker, stats)
        self.verifies: CallMerger[VerifyCall, list[VerifiedChunk], target_pb2.VerifyResponse] = self.merged(
            "Verify", functools.partial(verify_together, engine),
            lambda call, results: _verify_response(results, engine.room([item.slot_id for item in call.items])),
            backoff_holds=VERIFY_BACKOFF_HOLDS)

    @grpc_errors
    async def Prefill(
        self, request: target_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.PrefillResponse:
        items = [PrefillItem.from_pb(item) for item in request.items]
        slots = [item.slot_id for item in items]
        response, compute_s = await self.worker.run_timed(
            functools.partial(self.engine.prefill, items, Lease.from_pb(request.lease)),
            lambda results: _prefill_response(results, self.engine.room(slots)),
        )
        self.stats.record_work("Prefill", compute_s, len(items), sum(len(i.prompt_tokens) for i in items))
        response.compute_s = compute_s
        return response

    @grpc_errors
    async def Verify(
        self, request: target_pb2.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.VerifyResponse:
        return await self._verify(request, context.time_remaining())

    async def VerifyStream(
        self, requests: AsyncIterator[target_pb2.VerifyRequest], context: grpc.aio.ServicerContext
    ) -> None:
        await self.answer_each(context, "Verify", self._verify)

    async def _verify(
        self, request: target_pb2.VerifyRequest, remaining: float | None = None
    ) -> target_pb2.VerifyResponse:
        """`remaining`: seconds left of the call's gRPC deadline; without one, the request's timeout_s."""
        if not math.isfinite(request.timeout_s) or request.timeout_s < 0:
            raise InvalidArgumentError(f"timeout_s must be a finite number of seconds >= 0, got {request.timeout_s}",
                                       field="timeout_s")
        items = [VerifyItem.from_pb(item) for item in request.items]
        if remaining is None and request.timeout_s > 0:
            remaining = request.timeout_s
        deadline = time.monotonic() + remaining if remaining is not None else None
        holder = self.engine.leases.holder_of(items[0].slot_id) if items else None
        answer = await self.verifies.submit(VerifyCall(items, deadline, holder))
        return stamped(answer)

    @grpc_stream_errors
    async def ExportKV(
        self, request: target_pb2.ExportKVRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KVPiece]:
        dtype = torch_dtype(request.dtype or common_pb2.DTYPE_FLOAT32)
        export = functools.partial(self.engine.export_kv, request.slot_id, request.start, request.end,
                                   request.num_layers, dtype)
        pieces, compute_s = await self.worker.run_timed(export, lambda kv: list(split_pieces(kv)))
        self.stats.record_work("ExportKV", compute_s, 1, request.end - request.start)
        for piece in pieces:
            yield piece


def _prefill_response(results: list[ScoredChunk], room: PoolRoom) -> target_pb2.PrefillResponse:
    """`room`: taken on the worker right after the call, so that it counts the call's slots."""
    return target_pb2.PrefillResponse(results=[r.to_pb() for r in results], room=room.to_pb())


def _verify_response(results: list[VerifiedChunk], room: PoolRoom) -> target_pb2.VerifyResponse:
    return target_pb2.VerifyResponse(results=[verified_to_pb(r) for r in results], room=room.to_pb())


async def create_server(config: TargetConfig, engine: TargetEngine | None = None) -> RunningServer:
    """Load the model (unless an engine is given) and start serving; returns the bound server."""
    return await start_model_service(
        config, engine, TargetEngine, TargetServicer,
        target_pb2_grpc.add_TargetServiceServicer_to_server, SERVICE_NAME, ["Prefill", "Verify", "ExportKV"],
    )
