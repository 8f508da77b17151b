"""The target gRPC servicer: protobuf in, engine call on the model worker, protobuf out."""

from __future__ import annotations

import grpc

from specdec.serving.convert import prefill_item_from_pb, verify_item_from_pb
from specdec.serving.errors import grpc_errors
from specdec.serving.grpc_server import RunningServer
from specdec.serving.model_service import SlotServicer, start_model_service
from specdec.target_server.config import TargetConfig
from specdec.target_server.engine import TargetEngine
from specdec.v1 import target_pb2, target_pb2_grpc
from specdec.wire.tensor_codec import encode_tensor

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


class TargetServicer(SlotServicer, target_pb2_grpc.TargetServiceServicer):
    """Prefill and Verify; Info, Truncate and Release come from `SlotServicer`."""

    engine: TargetEngine

    @grpc_errors
    async def Prefill(
        self, request: target_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.PrefillResponse:
        items = [prefill_item_from_pb(item) for item in request.items]
        results, compute_s = await self.worker.run_timed(self.engine.prefill, items)
        return target_pb2.PrefillResponse(
            results=[
                target_pb2.PrefillResult(slot_id=r.slot_id, logits=encode_tensor(r.logits), cached_len=r.cached_len)
                for r in results
            ],
            compute_s=compute_s,
        )

    @grpc_errors
    async def Verify(
        self, request: target_pb2.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.VerifyResponse:
        items = [verify_item_from_pb(item) for item in request.items]
        results, compute_s = await self.worker.run_timed(self.engine.verify, items)
        return target_pb2.VerifyResponse(
            results=[
                target_pb2.VerifyResult(slot_id=r.slot_id, logits=encode_tensor(r.logits), cached_len=r.cached_len)
                for r in results
            ],
            compute_s=compute_s,
        )


async def create_server(config: TargetConfig, engine: TargetEngine | None = None) -> RunningServer:
    """Load the model (unless an engine is given) and start serving; returns the bound server."""
    return await start_model_service(
        config, engine, TargetEngine, TargetServicer,
        target_pb2_grpc.add_TargetServiceServicer_to_server, SERVICE_NAME,  # type: ignore[arg-type]
    )
