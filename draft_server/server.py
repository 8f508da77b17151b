"""The draft gRPC servicer: protobuf in, engine call on the model worker, protobuf out."""

from __future__ import annotations

import asyncio

import grpc

from draft_server.config import DraftConfig
from draft_server.engine import DraftEngine, ProposeItem
from specdec.model.runtime import build_runtime
from specdec.serving.convert import engine_info_to_pb, sampling_from_pb
from specdec.serving.errors import grpc_errors
from specdec.serving.grpc_server import RunningServer, start_server
from specdec.serving.worker import ModelWorker
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specdec.wire.tensor_codec import encode_tensor, torch_dtype

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, engine: DraftEngine, worker: ModelWorker) -> None:
        self.engine = engine
        self.worker = worker

    @grpc_errors
    async def Info(self, request: common_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> common_pb2.ModelInfo:
        return engine_info_to_pb(await self.worker.run(self.engine.info))

    @grpc_errors
    async def Propose(
        self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.ProposeResponse:
        items = [
            ProposeItem(
                slot_id=item.slot_id, valid_len=item.valid_len, new_tokens=list(item.new_tokens),
                k=item.k, sampling=sampling_from_pb(item.sampling),
            )
            for item in request.items
        ]
        probs_dtype = torch_dtype(request.probs_dtype or common_pb2.DTYPE_FLOAT32)
        proposals = await self.worker.run(self.engine.propose, items, probs_dtype)
        return draft_pb2.ProposeResponse(
            results=[
                draft_pb2.ProposeResult(
                    slot_id=p.slot_id, tokens=p.tokens, cached_len=p.cached_len,
                    probs=encode_tensor(p.probs) if p.probs is not None else None,
                )
                for p in proposals
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


def build_engine(config: DraftConfig) -> DraftEngine:
    runtime = build_runtime(
        config.model, dtype=config.dtype, device=config.device,
        quantization=config.quantization, num_layers=config.num_layers,
    )
    return DraftEngine(runtime, config)


async def create_server(config: DraftConfig, engine: DraftEngine | None = None) -> RunningServer:
    """Load the model (unless an engine is given) and start serving; returns the bound server."""
    # All torch work of the service happens on this one thread, model loading included: a
    # second thread running OpenMP kernels (e.g. the main thread that loaded the model)
    # keeps its own thread team and roughly halves small-kernel speed on a 2-core machine.
    worker = ModelWorker("draft-model")
    if engine is None:
        engine = await worker.run(build_engine, config)
    servicer = DraftServicer(engine, worker)
    return await start_server(
        lambda server: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server),
        [SERVICE_NAME],
        host=config.host,
        port=config.port,
        max_message_bytes=config.max_message_bytes,
        on_stop=lambda: asyncio.to_thread(worker.shutdown),  # waits for the running batch off the loop
    )
