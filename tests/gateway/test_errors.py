"""Bad input and overload get precise statuses; gateway start-up refuses bad configurations."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from specdec.client import build_request
from specdec.errors import InvalidArgumentError
from specdec.gateway.config import GatewayConfig
from specdec.gateway.server import create_gateway
from specdec.model.runtime import ModelRuntime
from specdec.model.tokenizer_info import TokenizerMismatchError
from specdec.v1 import gateway_pb2
from tests.support.services import LoopThread, slow_down
from tests.support.stacks import Stack, StartStack

STORY = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]


def _status(stack: Stack, request: gateway_pb2.GenerateRequest) -> grpc.RpcError:
    with stack.client() as client, pytest.raises(grpc.RpcError) as info:
        list(client.stub.Generate(request, timeout=60))
    return info.value


@pytest.mark.parametrize(
    "request_, field",
    [
        (gateway_pb2.GenerateRequest(), "input"),
        (build_request(""), "prompt"),
        (build_request([]), "chat"),
        (build_request("hi", temperature=-1.0), "temperature"),
        (build_request("hi", top_p=1.5), "top_p"),
        (build_request("hi", top_k=-3), "top_k"),
        (build_request("hi", max_new_tokens=-2), "max_new_tokens"),
        (build_request("hi", num_speculative_tokens=0), "num_speculative_tokens"),
        (build_request("hi", num_speculative_tokens=99), "num_speculative_tokens"),
        (build_request([{"role": "wizard", "content": "hi"}]), "chat.messages[0].role"),
        (build_request([{"role": "user", "content": "hi"}, {"role": "", "content": "x"}]), "chat.messages[1].role"),
        (build_request("hi", stop=["."] * 17), "stop"),
        (build_request("hi", stop=["x" * 257]), "stop[0]"),
        (build_request("hi", stop=["ok", ""]), "stop[1]"),
        (build_request("hi", min_p=1.5), "min_p"),
        (build_request("hi", presence_penalty=2.5), "presence_penalty"),
        (build_request("hi", frequency_penalty=-3.0), "frequency_penalty"),
        (build_request("hi", logit_bias={5: 150.0}), "logit_bias"),
        (build_request("hi", logit_bias={10: 1.0, 49_152: 1.0}), "logit_bias: token id 49152"),
        (build_request("hi", logit_bias={-1: 1.0}), "logit_bias: token id -1"),
    ],
    ids=["no-input", "empty-prompt", "empty-chat", "temperature", "top_p", "top_k", "max_new_tokens", "spec-0",
         "spec-99", "unknown-role", "empty-role", "too-many-stops", "long-stop", "empty-stop", "min_p",
         "presence", "frequency", "bias-range", "bias-vocab", "bias-negative-id"],
)
def test_invalid_requests_are_invalid_argument(
    int8_stack: Stack, request_: gateway_pb2.GenerateRequest, field: str
) -> None:
    error = _status(int8_stack, request_)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (error.details() or "")


def test_the_model_draft_without_a_draft_service_is_refused(start_stack: StartStack) -> None:
    stack = start_stack(None)
    error = _status(stack, build_request("hi", method="model"))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "speculation.method" in (error.details() or "")
    with stack.client() as client:
        assert client.generate("hi", max_new_tokens=3).completion_tokens == 3  # plain decoding works
        assert client.generate("hi", max_new_tokens=3, speculative=True).completion_tokens == 3  # lookups do


def test_full_queue_is_resource_exhausted(
    start_stack: StartStack, int8_runtime: ModelRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = start_stack(int8_runtime, max_batch_size=1, max_queue=1)
    # The first request takes seconds (at least 0.3 s a round) on any machine: the other three
    # arrive while it runs.
    slow_down(monkeypatch, stack.target, "verify", 0.3)
    with stack.client() as client, ThreadPoolExecutor(4) as pool:
        calls = [client.stub.Generate(build_request(STORY, max_new_tokens=30), timeout=120) for _ in range(4)]
        outcomes = list(pool.map(lambda call: _outcome(call), calls))
    # At most one running and one queued while the first 30-token request decodes; whether
    # the second arrives before or after the first was admitted decides if it is queued.
    assert 1 <= outcomes.count("ok") <= 2
    assert outcomes.count("RESOURCE_EXHAUSTED") == 4 - outcomes.count("ok")
    stack.wait_until_idle()


def _outcome(call: Iterable[object]) -> str:
    try:
        for _ in call:
            pass
        return "ok"
    except grpc.RpcError as error:
        return error.code().name


def test_requests_beyond_kv_capacity_wait_and_then_complete(
    start_stack: StartStack, int8_runtime: ModelRuntime
) -> None:
    """With room for one whole request at a time, both start, the newer one is preempted when
    the pools run out and resumes later: both complete, with the same greedy output."""
    stack = start_stack(int8_runtime, target=dict(kv_token_budget=192), draft=dict(kv_token_budget=192))
    with stack.client() as client, ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: client.generate(STORY, max_new_tokens=100, num_speculative_tokens=4),
                                range(2)))
    assert [r.completion_tokens for r in results] == [100, 100]
    assert results[0].token_ids == results[1].token_ids
    stack.wait_until_idle()


def test_config_validation() -> None:
    with pytest.raises(InvalidArgumentError, match="speculation_method model needs a draft"):
        GatewayConfig(target_address="127.0.0.1:1", speculative=True, speculation_method="model")
    with pytest.raises(InvalidArgumentError, match="n-gram lengths"):
        GatewayConfig(target_address="127.0.0.1:1", ngram_min=3, ngram_max=2)
    with pytest.raises(InvalidArgumentError, match="num_speculative_tokens"):
        GatewayConfig(target_address="127.0.0.1:1", draft_address="127.0.0.1:2", num_speculative_tokens=-1)
    with pytest.raises(InvalidArgumentError, match="draft_probs_dtype"):
        GatewayConfig(target_address="127.0.0.1:1", speculative=False, draft_probs_dtype="int4")


def test_gateway_refuses_num_speculative_tokens_above_the_services_maximum(
    int8_stack: Stack, service_loop: LoopThread
) -> None:
    target, draft = (f"127.0.0.1:{s.port}" for s in int8_stack.servers)
    config = GatewayConfig(target_address=target, draft_address=draft, port=0, num_speculative_tokens=9)
    with pytest.raises(InvalidArgumentError, match="maximum 8"):
        service_loop.run(create_gateway(config))


def test_gateway_refuses_a_draft_with_another_tokenizer(
    start_stack: StartStack, int8_runtime: ModelRuntime, service_loop: LoopThread
) -> None:
    """A draft whose tokenizer fingerprint differs from the target's must not be used.

    A stack of its own: the shared stack's gateway would see the altered fingerprint in its
    Info polls and report it to the tests that follow."""
    stack = start_stack(int8_runtime)
    assert stack.draft is not None
    stack.draft.tokenizer_info = dataclasses.replace(stack.draft.tokenizer_info, fingerprint="0" * 64)
    target, draft = (f"127.0.0.1:{s.port}" for s in stack.servers)
    with pytest.raises(TokenizerMismatchError, match="fingerprints differ"):
        service_loop.run(create_gateway(GatewayConfig(target_address=target, draft_address=draft, port=0)))


def test_gateway_info_describes_both_models(int8_stack: Stack) -> None:
    with int8_stack.client() as client:
        info = client.info()
    assert info.speculative_enabled and info.default_num_speculative_tokens == 8 and info.max_speculative_tokens == 8
    assert info.target.tokenizer_fingerprint == info.draft.tokenizer_fingerprint
    assert info.target.dtype == "float32" and info.draft.quantization == "int8"


def test_a_target_cut_to_its_first_layers_serves_through_the_gateway(
    start_stack: StartStack, weak_runtime: ModelRuntime, int8_runtime: ModelRuntime
) -> None:
    """`--num-layers` renames the model for display; the gateway loads its tokenizer from the
    unchanged model id (this failed at start-up while one field was both)."""
    stack = start_stack(int8_runtime, target_runtime=weak_runtime, target={"num_layers": 2})
    with stack.client() as client:
        info = client.info()
        result = client.generate([{"role": "user", "content": "Hello!"}], max_new_tokens=6)
    assert info.target.model_id == "smollm2-135m"
    assert info.target.model_name == "smollm2-135m (first 2 layers)"
    assert result.completion_tokens == 6 and result.num_draft_tokens > 0
    stack.wait_until_idle()


def test_an_oversized_request_is_resource_exhausted_and_the_gateway_keeps_serving(int8_stack: Stack) -> None:
    error = _status(int8_stack, build_request("x" * (5 * 1024 * 1024)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with int8_stack.client() as client:
        assert client.generate("Hello", max_new_tokens=3).completion_tokens == 3
