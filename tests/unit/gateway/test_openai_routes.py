"""The HTTP front's routes against a fake gateway: the failures a live stack cannot show
cheaply (a full queue, the target down before or after the first token, health)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import grpc
from aiohttp.test_utils import TestClient, TestServer

from specdec.errors import CapacityExhaustedError
from specdec.gateway.openai.app import OpenAIFront
from specdec.gateway.openai.protocol import ServedModel
from specdec.v1 import gateway_pb2

MODEL = ServedModel("tiny", frozenset({"tiny"}), 128)
BODY = {"prompt": "hi", "max_tokens": 4}
FAILED = gateway_pb2.GenerateResponse(completion=gateway_pb2.Completion(
    finish_reason=gateway_pb2.FINISH_REASON_ERROR, error_message="the target service is not answering"))


class FakeGenerations:
    """Answers every request with `responses`, or refuses it with `refusal`."""

    def __init__(self, responses: list[gateway_pb2.GenerateResponse], refusal: Exception | None = None) -> None:
        self.messages = responses
        self.refusal = refusal
        self.error_status = grpc.StatusCode.UNAVAILABLE

    @asynccontextmanager
    async def start(self, request: gateway_pb2.GenerateRequest) -> AsyncIterator[FakeGenerations]:
        if self.refusal is not None:
            raise self.refusal
        yield self

    async def responses(self) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        for message in self.messages:
            yield message


def serve(generations: FakeGenerations, check: Callable[[TestClient[Any, Any]], Awaitable[None]],
          target_available: bool = True) -> None:
    state = SimpleNamespace(target_available=target_available, serving=target_available, draining=False,
                            config=SimpleNamespace(max_request_bytes=4096),
                            policy=SimpleNamespace(tokenizer=None))  # no test here asks for logprobs
    front = OpenAIFront(state, generations, MODEL)  # type: ignore[arg-type]

    async def run() -> None:
        async with TestClient(TestServer(front.application(token=""))) as client:
            await check(client)

    asyncio.run(run())


def test_health_follows_the_target() -> None:
    async def check(client: TestClient[Any, Any]) -> None:
        reply = await client.get("/health")
        assert reply.status == 503 and await reply.json() == {"status": "unavailable"}

    serve(FakeGenerations([]), check, target_available=False)


def test_a_full_queue_is_a_429() -> None:
    async def check(client: TestClient[Any, Any]) -> None:
        reply = await client.post("/v1/completions", json={**BODY, "stream": True})
        assert reply.status == 429
        error = (await reply.json())["error"]
        assert error["type"] == "rate_limit_error" and "queue is full" in error["message"]

    serve(FakeGenerations([], CapacityExhaustedError("admission queue is full (1 waiting)", resource="queue")), check)


def test_a_target_down_before_the_first_token_is_a_503_even_when_streaming() -> None:
    async def check(client: TestClient[Any, Any]) -> None:
        for stream in (False, True):
            reply = await client.post("/v1/completions", json={**BODY, "stream": stream})
            assert reply.status == 503, stream
            assert (await reply.json())["error"]["code"] == "service_unavailable"

    serve(FakeGenerations([FAILED]), check)


def test_a_failure_mid_stream_is_an_error_event_then_done() -> None:
    async def check(client: TestClient[Any, Any]) -> None:
        reply = await client.post("/v1/completions", json={**BODY, "stream": True})
        assert reply.status == 200
        events = (await reply.text()).removesuffix("\n\n").split("\n\n")
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[0].removeprefix("data: "))["choices"][0]["text"] == "Hel"
        error = json.loads(events[1].removeprefix("data: "))["error"]
        assert error["code"] == "service_unavailable" and len(events) == 3

    serve(FakeGenerations([gateway_pb2.GenerateResponse(token_ids=[1], text="Hel"), FAILED]), check)


def test_unknown_paths_and_bad_json_answer_in_openai_shape() -> None:
    async def check(client: TestClient[Any, Any]) -> None:
        missing = await client.get("/v1/embeddings")
        assert missing.status == 404 and "error" in await missing.json()
        wrong_method = await client.get("/v1/completions")
        assert wrong_method.status == 405 and "error" in await wrong_method.json()
        garbled = await client.post("/v1/completions", data=b"{not json")
        assert garbled.status == 400 and "not valid JSON" in (await garbled.json())["error"]["message"]
        large = await client.post("/v1/completions", json={"prompt": "x" * 5000})
        assert large.status == 413 and (await large.json())["error"]["code"] == "request_too_large"

    serve(FakeGenerations([]), check)
