"""The draft gRPC servicer: protobuf in, engine call on the model worker, protobuf out (encoded
on the worker too: the event loop only sends it)."""

from __future__ import annotations

import functools
import math
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from dataclasses import dataclass

import grpc
import torch

from specdec.draft_server.config import DraftConfig
from specdec.draft_server.engine import DraftEngine
from specdec.errors import InvalidArgumentError
from specdec.serving.call_merger import CallMerger, stamped
from specdec.serving.errors import grpc_errors
from specdec.serving.grpc_server import RunningServer
from specdec.serving.metrics import ServiceStats
from specdec.serving.model_service import SlotServicer, start_model_service
from specdec.serving.serial_executor import SerialExecutor
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specdec.wire.items import Lease, Proposal, ProposeItem
from specdec.wire.kv_transfer import ImportHeader, assemble_pieces
from specdec.wire.model_info import PoolRoom
from specdec.wire.tensor_codec import torch_dtype

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


@dataclass(frozen=True)
class ProposeCall:
    """One Propose's requests, as the call merger runs them; calls merge only with calls that
    want their probabilities in the same dtype."""

    items: list[ProposeItem]
    lease: Lease | None
    holder: str | None
    probs_dtype: torch.dtype

    @property
    def key(self) -> Hashable:
        return self.probs_dtype

    @property
    def rows(self) -> int:
        return len(self.items)

    @property
    def tokens(self) -> int:
        return sum(len(item.new_tokens) + item.num_speculative_tokens for item in self.items)


def propose_together(engine: DraftEngine, calls: Sequence[ProposeCall]) -> list[list[Proposal]]:
    return engine.propose_together([(call.items, call.lease) for call in calls], calls[0].probs_dtype)


class DraftServicer(SlotServicer, draft_pb2_grpc.DraftServiceServicer):
    """Propose and ImportKV; Info, Truncate and Release come from `SlotServicer`. Propose
    calls from several gateways run merged (`specdec.serving.call_merger`)."""

    engine: DraftEngine

    def __init__(self, engine: DraftEngine, worker: SerialExecutor, stats: ServiceStats) -> None:
        super().__init__(engine, worker, stats)
        self.proposals: CallMerger[ProposeCall, list[Proposal], draft_pb2.ProposeResponse] = self.merged(
            "Propose", functools.partial(propose_together, engine),
            lambda call, proposals: _propose_response(proposals, engine.room([item.slot_id for item in call.items])))

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
        holder = lease.holder if lease else self.engine.leases.holder_of(items[0].slot_id) if items else None
        answer = await self.proposals.submit(ProposeCall(items, lease, holder, probs_dtype))
        return stamped(answer)

    @grpc_errors
    async def ImportKV(
        self, requests: AsyncIterator[draft_pb2.ImportKVRequest], context: grpc.aio.ServicerContext
    ) -> draft_pb2.ImportKVResponse:
        header, pieces = await _import_parts(requests, self._import_bytes)
        shape = self.engine.import_shape(header)

        def work() -> int:  # the header, then the pieces are checked whole before the slot changes
            self.engine.check_import(header)
            return self.engine.import_kv(header, assemble_pieces(pieces, shape, self.engine.cache.dtype))

        cached_len, compute_s = await self.worker.run_timed(work, lambda length: length)
        self.stats.record_work("ImportKV", compute_s, 1, len(header.tokens))
        return draft_pb2.ImportKVResponse(cached_len=cached_len, compute_s=compute_s)

    def _import_bytes(self, header: ImportHeader) -> int:
        """The most bytes of pieces an import of `header` may send: its keys and values in fp32,
        the widest dtype on the wire (checked before they are held, so no stream can pile up
        more)."""
        if len(header.tokens) > self.engine.max_seq_len:
            raise InvalidArgumentError(f"tokens: {len(header.tokens)} to import, past max_seq_len "
                                       f"{self.engine.max_seq_len}", field="tokens")
        return math.prod(self.engine.import_shape(header)) * 4


async def _import_parts(
    requests: AsyncIterator[draft_pb2.ImportKVRequest], max_bytes: Callable[[ImportHeader], int]
) -> tuple[ImportHeader, list[common_pb2.KVPiece]]:
    """The header (the first message) and the pieces after it, at most `max_bytes(header)` of them."""
    header: ImportHeader | None = None
    pieces: list[common_pb2.KVPiece] = []
    budget = 0
    async for message in requests:
        if message.HasField("header"):
            if header is not None:
                raise InvalidArgumentError("header: sent more than once", field="header")
            header = ImportHeader.from_pb(message.header)
            budget = max_bytes(header)
        elif header is None:
            raise InvalidArgumentError("header: must come first, before any piece", field="header")
        else:
            budget -= len(message.piece.kv.data)
            if budget < 0:
                raise InvalidArgumentError(f"pieces: more bytes than {len(header.tokens)} tokens' keys and values",
                                           field="pieces")
            pieces.append(message.piece)
    if header is None:
        raise InvalidArgumentError("header: none was sent", field="header")
    return header, pieces


def _propose_response(proposals: list[Proposal], room: PoolRoom) -> draft_pb2.ProposeResponse:
    """`room`: taken on the worker right after the call, so that it counts the call's slots."""
    return draft_pb2.ProposeResponse(results=[p.to_pb() for p in proposals], room=room.to_pb())


async def create_server(config: DraftConfig, engine: DraftEngine | None = None) -> RunningServer:
    """Load the model (unless an engine is given) and start serving; returns the bound server."""
    return await start_model_service(
        config, engine, DraftEngine, DraftServicer,
        draft_pb2_grpc.add_DraftServiceServicer_to_server, SERVICE_NAME, ["Propose", "ImportKV"],
    )
