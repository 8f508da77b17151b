"""Async clients of the target and draft services, speaking domain types.

The gateway's scheduler calls these; they own the protobuf conversion in both directions
and nothing else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Generic, TypeVar

import grpc
import torch

from specdec.serving.convert import prefill_item_to_pb, propose_item_to_pb, verify_item_to_pb
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specdec.wire.items import PrefillItem, ProposeItem, VerifyItem
from specdec.wire.limits import message_size_options
from specdec.wire.tensor_codec import decode_tensor

T = TypeVar("T")


@dataclass(frozen=True)
class Timed(Generic[T]):
    """A model service's reply with its two costs: compute on the service, and the call's
    wall time as the gateway saw it (compute + queueing + (de)serialisation + transport)."""

    value: T
    compute_s: float
    wall_s: float


@dataclass(frozen=True)
class DraftProposal:
    tokens: list[int]  # [k]
    probs: torch.Tensor | None  # [k, vocab] float32, rows normalized; None for greedy


def _channel(address: str, max_message_bytes: int) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=message_size_options(max_message_bytes))


class TargetClient:
    def __init__(self, address: str, max_message_bytes: int) -> None:
        self.channel = _channel(address, max_message_bytes)
        self.stub = target_pb2_grpc.TargetServiceStub(self.channel)

    async def info(self) -> common_pb2.ModelInfo:
        return await self.stub.Info(common_pb2.InfoRequest(), wait_for_ready=True, timeout=120)

    async def prefill(self, items: list[PrefillItem]) -> Timed[dict[str, torch.Tensor]]:
        """Last-position logits [vocab] per slot."""
        started = time.perf_counter()
        request = target_pb2.PrefillRequest(items=[prefill_item_to_pb(item) for item in items])
        response = await self.stub.Prefill(request)
        logits = {r.slot_id: decode_tensor(r.logits) for r in response.results}
        return Timed(logits, response.compute_s, time.perf_counter() - started)

    async def verify(self, items: list[VerifyItem]) -> Timed[dict[str, torch.Tensor]]:
        """Logits [K+1, vocab] per slot."""
        started = time.perf_counter()
        request = target_pb2.VerifyRequest(items=[verify_item_to_pb(item) for item in items])
        response = await self.stub.Verify(request)
        logits = {r.slot_id: decode_tensor(r.logits) for r in response.results}
        return Timed(logits, response.compute_s, time.perf_counter() - started)

    async def release(self, slot_id: str) -> None:
        await self.stub.Release(common_pb2.ReleaseRequest(slot_id=slot_id))

    async def close(self) -> None:
        await self.channel.close()


class DraftClient:
    def __init__(self, address: str, max_message_bytes: int, probs_dtype: common_pb2.DType) -> None:
        self.channel = _channel(address, max_message_bytes)
        self.stub = draft_pb2_grpc.DraftServiceStub(self.channel)
        self.probs_dtype = probs_dtype

    async def info(self) -> common_pb2.ModelInfo:
        return await self.stub.Info(common_pb2.InfoRequest(), wait_for_ready=True, timeout=120)

    async def propose(self, items: list[ProposeItem]) -> Timed[dict[str, DraftProposal]]:
        started = time.perf_counter()
        message = draft_pb2.ProposeRequest(items=[propose_item_to_pb(item) for item in items], probs_dtype=self.probs_dtype)
        response = await self.stub.Propose(message)
        proposals = {}
        for result in response.results:
            probs = None
            if result.HasField("probs"):
                q = decode_tensor(result.probs).float()  # [k, vocab]
                # The draft sampled from the (possibly rounded) q with multinomial, which
                # normalizes: normalize the same way so acceptance uses that very q.
                probs = q / q.sum(dim=-1, keepdim=True)
            proposals[result.slot_id] = DraftProposal(tokens=list(result.tokens), probs=probs)
        return Timed(proposals, response.compute_s, time.perf_counter() - started)

    async def release(self, slot_id: str) -> None:
        await self.stub.Release(common_pb2.ReleaseRequest(slot_id=slot_id))

    async def close(self) -> None:
        await self.channel.close()
