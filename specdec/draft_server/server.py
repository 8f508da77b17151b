"""The draft gRPC servicer: protobuf in, engine call on the model worker, protobuf out (encoded
on the worker too: the event loop only sends it)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

import grpc

from specdec.draft_server.config import DraftConfig
from specdec.draft_server.engine import DraftEngine
from specdec.serving.errors import grpc_errors
from specdec.serving.grpc_server import RunningServer
from specdec.serving.model_service import SlotServicer, start_model_service
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specdec.wire.items import Lease, Proposal, ProposeItem
from specdec.wire.tensor_codec import torch_dtype

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


class DraftServicer(SlotServicer, draft_pb2_grpc.DraftServiceServicer):
    """Propose; Info, Truncate and Release come from `SlotServicer`."""

    engine: DraftEngine

    @grpc_errors
    async def Propose(
        self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.ProposeResponse:
        return await self._propose(request)

    async def ProposeStream(
        self, requests: AsyncIterator[draft_pb2.ProposeRequest], context: grpc.aio.ServicerContext
    ) -> None:
        await self.answer_each(context, "Propose", self._propose)

    async def _propose(self, request: draft_pb2.ProposeRequest) -> draft_pb2.ProposeResponse:
        items = [ProposeItem.from_pb(item) for item in request.items]
        probs_dtype = torch_dtype(request.probs_dtype or common_pb2.DTYPE_FLOAT32)
        lease = Lease.from_pb(request.lease)
        response, compute_s = await self.worker.run_timed(
            functools.partial(self.engine.propose, items, probs_dtype, lease), _propose_response
        )
        fed_and_drafted = sum(len(i.new_tokens) + i.num_speculative_tokens for i in items)
        self.stats.record_work("Propose", compute_s, len(items), fed_and_drafted)
        response.compute_s = compute_s
        return response


def _propose_response(proposals: list[Proposal]) -> draft_pb2.ProposeResponse:
    return draft_pb2.ProposeResponse(results=[p.to_pb() for p in proposals])


async def create_server(config: DraftConfig, engine: DraftEngine | None = None) -> RunningServer:
    """Load the model (unless an engine is given) and start serving; returns the bound server."""
    return await start_model_service(
        config, engine, DraftEngine, DraftServicer,
        draft_pb2_grpc.add_DraftServiceServicer_to_server, SERVICE_NAME, ["Propose"],
    )
