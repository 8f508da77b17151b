"""Model-service failures: a lost draft degrades to plain decoding, a lost target fails cleanly."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import pytest

from specdec.client import build_request
from specdec.v1 import gateway_pb2

STORY = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]


def _eventually(condition: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _kill(stack, index: int, service_loop) -> None:  # type: ignore[no-untyped-def]
    """Stop one model server of the stack at once (and keep teardown from stopping it again)."""
    server = stack.servers.pop(index)
    service_loop.run(server.stop(grace=0))


def test_losing_the_draft_mid_stream_falls_back_to_plain_decoding(start_stack, int8_runtime, service_loop) -> None:  # type: ignore[no-untyped-def]
    stack = start_stack(int8_runtime)
    with stack.client() as client:
        reference = client.generate(STORY, max_new_tokens=30, speculative=False)
        tokens: list[int] = []
        completion = None
        for response in client.stub.Generate(build_request(STORY, max_new_tokens=30, num_speculative_tokens=4), timeout=120):
            tokens.extend(response.token_ids)
            if len(tokens) >= 5 and len(stack.servers) == 2:
                _kill(stack, 1, service_loop)  # the draft goes away mid-stream
            if response.HasField("completion"):
                completion = response.completion
    assert tokens == reference.token_ids  # the same output, only without speculation
    assert completion is not None and completion.finish_reason == gateway_pb2.FINISH_REASON_LENGTH
    assert _eventually(lambda: not stack.target.tokens), "the target slot was not released"


def test_losing_the_target_fails_the_stream_and_frees_the_draft_slot(start_stack, int8_runtime, service_loop) -> None:  # type: ignore[no-untyped-def]
    stack = start_stack(int8_runtime)
    completion = None
    with stack.client() as client, pytest.raises(grpc.RpcError) as error:
        for response in client.stub.Generate(build_request(STORY, max_new_tokens=200, num_speculative_tokens=4), timeout=120):
            if len(stack.servers) == 2 and stack.draft.tokens:
                _kill(stack, 0, service_loop)  # the target goes away once the draft holds the slot
            if response.HasField("completion"):
                completion = response.completion
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert completion is not None and completion.finish_reason == gateway_pb2.FINISH_REASON_ERROR
    assert "UNAVAILABLE" in completion.error_message  # the final message comes before the status
    assert "127.0.0.1" not in completion.error_message and "127.0.0.1" not in error.value.details()  # no internal address
    assert _eventually(lambda: not stack.draft.tokens), "the failed request's draft slot was not released"
