"""The target gRPC servicer: protobuf in, engine call on the model worker, protobuf out."""

from __future__ import annotations

import asyncio

import grpc

from specdec.model.runtime import build_runtime
from specdec.serving.convert import engine_info_to_pb
from specdec.serving.errors import grpc_errors
from specdec.serving.grpc_server import RunningServer, start_server
from specdec.serving.worker import ModelWorker
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from specdec.wire.tensor_codec import encode_tensor
from target_server.config import TargetConfig
from target_server.engine import PrefillItem, TargetEngine, VerifyItem

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, engine: TargetEngine, worker: ModelWorker) -> None:
        self.engine = engine
        self.worker = worker

    @grpc_errors
    async def Info(self, request: common_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> common_pb2.ModelInfo:
        return engine_info_to_pb(await self.worker.run(self.engine.info))

    @grpc_errors
    async def Prefill(
        self, request: target_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.PrefillResponse:
        items = [PrefillItem(item.slot_id, list(item.prompt_tokens)) for item in request.items]
        results = await self.worker.run(self.engine.prefill, items)
        return target_pb2.PrefillResponse(
            results=[
                target_pb2.PrefillResult(slot_id=r.slot_id, logits=encode_tensor(r.logits), cached_len=r.cached_len)
                for r in results
            ]
        )

    @grpc_errors
    async def Verify(
        self, request: target_pb2.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.VerifyResponse:
        items = [VerifyItem(item.slot_id, item.valid_len, list(item.tokens)) for item in request.items]
        results = await self.worker.run(self.engine.verify, items)
        return target_pb2.VerifyResponse(
            results=[
                target_pb2.VerifyResult(slot_id=r.slot_id, logits=encode_tensor(r.logits), cached_len=r.cached_len)
                for r in results
            ]
        )

    @grpc_errors
    async def Truncate(
        self, request: common_pb2.TruncateRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.TruncateResponse:
        length = await self.worker.run(self.engine.truncate, request.slot_id, request.new_len)
        return common_pb2.TruncateResponse(cached_len=length)

    @grpc_errors
    async def Release(
        self, request: common_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ReleaseResponse:
        await self.worker.run(self.engine.release, request.slot_id)
        return common_pb2.ReleaseResponse()


def build_engine(config: TargetConfig) -> TargetEngine:
    runtime = build_runtime(
        config.model, dtype=config.dtype, device=config.device,
        quantization=config.quantization, num_layers=config.num_layers,
    )
    return TargetEngine(runtime, config)


async def create_server(config: TargetConfig, engine: TargetEngine | None = None) -> RunningServer:
    """Load the model (unless an engine is given) and start serving; returns the bound server."""
    # All torch work of the service happens on this one thread, model loading included: a
    # second thread running OpenMP kernels (e.g. the main thread that loaded the model)
    # keeps its own thread team and roughly halves small-kernel speed on a 2-core machine.
    worker = ModelWorker("target-model")
    if engine is None:
        engine = await worker.run(build_engine, config)
    servicer = TargetServicer(engine, worker)
    return await start_server(
        lambda server: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server),
        [SERVICE_NAME],
        host=config.host,
        port=config.port,
        max_message_bytes=config.max_message_bytes,
        on_stop=lambda: asyncio.to_thread(worker.shutdown),  # waits for the running batch off the loop
    )
