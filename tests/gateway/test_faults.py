"""Model-service failures: a lost draft degrades to plain decoding, a lost target fails cleanly."""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.error
import urllib.request
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.client import SpecdecClient, build_request
from specdec.cost_model import ForwardCost
from specdec.draft_server.server import create_server as create_draft_server
from specdec.gateway.model_clients import INFO_TIMEOUT_S
from specdec.model.runtime import ModelRuntime
from specdec.target_server.server import create_server as create_target_server
from specdec.v1 import gateway_pb2
from tests.support.services import LoopThread, eventually, slow_down, target_server
from tests.support.stacks import DRAFT_COSTS, POOL, TARGET_COSTS, Stack, StartStack

MONITOR_INTERVAL_S = 2.0  # the gateway's default Info poll
STORY = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]


def _info(stack: Stack, timeout: float = 120.0) -> gateway_pb2.GatewayInfo:
    with stack.client(timeout) as client:
        return client.info()


def _gateway_health(stack: Stack) -> int:
    with grpc.insecure_channel(stack.address) as channel:
        return int(health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status)


def _kill(stack: Stack, index: int, service_loop: LoopThread) -> None:
    """Stop one model server of the stack at once (and keep teardown from stopping it again)."""
    server = stack.servers.pop(index)
    service_loop.run(server.stop(grace=0))


def test_losing_the_draft_mid_stream_falls_back_to_plain_decoding(
    start_stack: StartStack, int8_runtime: ModelRuntime, service_loop: LoopThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = start_stack(int8_runtime)
    with stack.client() as client:
        reference = client.generate(STORY, max_new_tokens=30, speculative=False)
        slow_down(monkeypatch, stack.target, "verify", 0.1)  # the stream still runs when the draft goes
        tokens: list[int] = []
        completion = None
        for response in client.stub.Generate(build_request(STORY, max_new_tokens=30, num_speculative_tokens=4),
                                             timeout=120):
            tokens.extend(response.token_ids)
            if len(tokens) >= 5 and len(stack.servers) == 2:
                _kill(stack, 1, service_loop)  # the draft goes away mid-stream
            if response.HasField("completion"):
                completion = response.completion
    assert tokens == reference.token_ids  # the same output, only without speculation
    assert completion is not None and completion.finish_reason == gateway_pb2.FINISH_REASON_LENGTH
    assert completion.speculation.num_plain_rounds > 0  # the draft went away before the end
    assert eventually(lambda: not stack.target.tokens), "the target slot was not released"


def test_a_target_restart_mid_stream_costs_the_request_only_time(
    start_stack: StartStack, int8_runtime: ModelRuntime, service_loop: LoopThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The target goes away mid-stream and comes back on its port: the request waits for it and
    resumes from its tokens (a Prefill of them), with the output it would have had."""
    stack = start_stack(int8_runtime)
    with stack.client() as client:
        expected = client.generate(STORY, max_new_tokens=32, speculative=False).token_ids
    slow_down(monkeypatch, stack.target, "verify", 0.05)  # the restart lands mid-stream
    port, tokens, restarted = stack.servers[0].port, [], False
    with stack.client() as client:
        for response in client.stub.Generate(build_request(STORY, max_new_tokens=32, num_speculative_tokens=4),
                                             timeout=120):
            tokens.extend(response.token_ids)
            if len(tokens) >= 10 and not restarted:
                _kill(stack, 0, service_loop)
                config = dataclasses.replace(stack.target.config, port=port)
                stack.servers.insert(0, service_loop.run(create_target_server(config, stack.target)))
                restarted = True
    assert restarted and tokens == expected
    stack.wait_until_idle()


def test_a_target_that_dies_mid_stream_hands_the_request_to_the_next_address_it_was_given(
    start_stack: StartStack, int8_runtime: ModelRuntime, fp32_runtime: ModelRuntime, service_loop: LoopThread,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gateway given two target addresses (a gRPC address list: pick_first connects to the first
    that answers) resumes a request whose target dies mid-stream on the second, from its tokens,
    with the output it would have had."""
    stack = start_stack(int8_runtime)
    spare_engine, spare_start = target_server(fp32_runtime, **POOL)
    spare = service_loop.run(spare_start)
    try:
        addresses = f"ipv4:127.0.0.1:{stack.servers[0].port},127.0.0.1:{spare.port}"
        gateway = start_stack.add_gateway(stack, target_address=addresses)
        with SpecdecClient(f"127.0.0.1:{gateway.port}", timeout=120) as client:
            reference = client.generate(STORY, max_new_tokens=32, speculative=False)
            assert spare_engine.prefix_cache_queries == 0  # the first address served it
            slow_down(monkeypatch, stack.target, "verify", 0.05)  # the kill lands mid-stream
            tokens: list[int] = []
            for response in client.stub.Generate(build_request(STORY, max_new_tokens=32, num_speculative_tokens=4),
                                                 timeout=120):
                tokens.extend(response.token_ids)
                if len(tokens) >= 10 and len(stack.servers) == 2:
                    _kill(stack, 0, service_loop)
        assert len(stack.servers) == 1 and tokens == reference.token_ids
        # Prefilled there with the tokens it had generated.
        assert spare_engine.prefix_cache_queries >= reference.prompt_tokens + 10
        assert eventually(lambda: not spare_engine.tokens), "the resumed request's slot was not released"
    finally:
        service_loop.run(spare.stop(grace=0))


def test_losing_the_target_fails_the_stream_and_frees_the_draft_slot(
    start_stack: StartStack, int8_runtime: ModelRuntime, service_loop: LoopThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A target that does not come back within `RESUME_WITHIN_S` (2 s here) fails its requests."""
    monkeypatch.setattr("specdec.gateway.target_outage.RESUME_WITHIN_S", 2.0)
    stack = start_stack(int8_runtime, http_port=0)
    assert _http_health(stack) == (200, {"status": "ok"})
    slow_down(monkeypatch, stack.target, "verify", 0.1)  # 200 tokens take seconds: the kill lands mid-stream
    completion = None
    with stack.client() as client, pytest.raises(grpc.RpcError) as error:
        for response in client.stub.Generate(build_request(STORY, max_new_tokens=200, num_speculative_tokens=4),
                                             timeout=120):
            if len(stack.servers) == 2 and stack.draft.tokens:
                _kill(stack, 0, service_loop)  # the target goes away once the draft holds the slot
            if response.HasField("completion"):
                completion = response.completion
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert completion is not None and completion.finish_reason == gateway_pb2.FINISH_REASON_ERROR
    assert "UNAVAILABLE" in completion.error_message  # the final message comes before the status
    # no internal address
    assert "127.0.0.1" not in completion.error_message and "127.0.0.1" not in error.value.details()
    assert eventually(lambda: not stack.draft.tokens), "the failed request's draft slot was not released"
    # Health tells the truth, and Info answers from what the gateway last saw: asking the lost
    # target would wait out INFO_TIMEOUT_S (it waits for a ready channel), past this deadline.
    assert eventually(lambda: _gateway_health(stack) == health_pb2.HealthCheckResponse.NOT_SERVING)
    assert not _info(stack, timeout=INFO_TIMEOUT_S / 2).target_available
    assert _http_health(stack) == (503, {"status": "unavailable"})  # the HTTP front's probe agrees


def _http_health(stack: Stack) -> tuple[int, Any]:
    """The HTTP front's /health: its status and body (urllib raises on a 503: its body is read there)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{stack.gateway.http_port}/health", timeout=5) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def test_a_hung_draft_costs_one_deadline_and_the_output_stays_exact(
    start_stack: StartStack, int8_runtime: ModelRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Propose that hangs (the draft's model worker blocked, as under SIGSTOP) misses its
    deadline: that round and the next run as plain decoding with the same tokens, and
    speculation resumes once the draft answers its health check."""
    stack = start_stack(int8_runtime, rpc_timeout_floor_s=2.0)
    with stack.client() as client:
        expected = client.generate(STORY, max_new_tokens=40, speculative=False).token_ids
    propose, hangs = stack.draft.propose_together, [4.0]

    def hanging_propose(*args: Any, **kwargs: Any) -> object:
        if hangs:
            time.sleep(hangs.pop())  # on the draft's model worker: Propose, not the loop, hangs
        return propose(*args, **kwargs)

    monkeypatch.setattr(stack.draft, "propose_together", hanging_propose)
    with stack.client() as client:
        result = client.generate(STORY, max_new_tokens=40, num_speculative_tokens=4)
        info = client.info()
    assert result.token_ids == expected
    assert not hangs, "the hang never happened"
    assert result.num_plain_rounds > 0  # the round whose Propose missed its deadline ran plain
    assert eventually(lambda: _info(stack).draft_available), "speculation never resumed"
    assert info.target_available
    stack.wait_until_idle()


def test_a_request_right_after_the_target_restarts_waits_for_it_instead_of_failing(
    start_stack: StartStack, service_loop: LoopThread
) -> None:
    """The gateway's connection to a restarted target is in reconnect backoff for a while:
    a Prefill waits for it within its deadline instead of failing with UNAVAILABLE."""
    stack = start_stack(None)
    port = stack.servers[0].port
    _kill(stack, 0, service_loop)
    with stack.client(timeout=3) as client:
        with pytest.raises(grpc.RpcError):  # the target is gone: the gateway's channel goes into backoff
            client.generate(STORY, max_new_tokens=2)
    restarted = service_loop.run(create_target_server(dataclasses.replace(stack.target.config, port=port),
                                                      stack.target))
    stack.servers.insert(0, restarted)
    with stack.client() as client:
        assert client.generate(STORY, max_new_tokens=4).completion_tokens == 4
    stack.wait_until_idle()


def _restart(
    stack: Stack, index: int, service_loop: LoopThread, tokenizer_fingerprint: str = "",
    forward_costs: tuple[ForwardCost, ...] = (), **config: Any
) -> None:
    """Replace model server `index` (0 target, 1 draft) by a fresh engine on the same port,
    with `config` changes, the cost table it advertises (pinned, none by default) and a
    tampered tokenizer fingerprint if given."""
    engine = stack.target if index == 0 else stack.draft
    port = stack.servers[index].port
    _kill(stack, index, service_loop)
    fresh = type(engine)(engine.runtime, dataclasses.replace(engine.config, port=port, **config))
    fresh.forward_costs = forward_costs
    if tokenizer_fingerprint:
        fresh.tokenizer_info = dataclasses.replace(fresh.tokenizer_info, fingerprint=tokenizer_fingerprint)
    create = create_target_server if index == 0 else create_draft_server
    stack.servers.insert(index, service_loop.run(create(fresh.config, fresh)))
    if index == 0:
        stack.target = fresh
    else:
        stack.draft = fresh


def _refusal(stack: Stack) -> tuple[grpc.StatusCode, bool] | None:
    """The status of a short generation (None if it succeeds), and whether it names the tokenizer."""
    with stack.client() as client:
        try:
            client.generate(STORY, max_new_tokens=2)
        except grpc.RpcError as error:
            return error.code(), "tokenizer fingerprints differ" in (error.details() or "")
    return None


def test_restarted_services_are_adopted_with_their_new_costs_or_refused(
    start_stack: StartStack, int8_runtime: ModelRuntime, service_loop: LoopThread
) -> None:
    """The gateway re-reads a restarted service's Info: new costs and pool are adopted, another
    tokenizer is refused (a draft: no speculation; a target: UNAVAILABLE) until it is fixed."""
    stack = start_stack(int8_runtime, adaptive_k=True)  # services without cost tables: K cannot adapt
    assert not _info(stack).adaptive_k
    with stack.client() as client:
        reference = client.generate(STORY, max_new_tokens=12, speculative=False).token_ids

    # Restarted with cost tables (pinned: what a restart measures is not the point) and a smaller pool.
    _restart(stack, 0, service_loop, forward_costs=TARGET_COSTS, max_slots=4)
    _restart(stack, 1, service_loop, forward_costs=DRAFT_COSTS, max_slots=4)
    assert eventually(lambda: (info := _info(stack)).adaptive_k and info.draft.max_slots == 4)
    info = _info(stack)
    assert tuple(map(ForwardCost.from_pb, info.draft.forward_costs)) == DRAFT_COSTS
    assert tuple(map(ForwardCost.from_pb, info.target.forward_costs)) == TARGET_COSTS
    with stack.client() as client:
        adaptive = client.generate(STORY, max_new_tokens=12)
    assert adaptive.token_ids == reference

    # The rest is about tokenizers, not costs.
    _restart(stack, 1, service_loop, tokenizer_fingerprint="0" * 64)
    assert eventually(lambda: not _info(stack).draft_available)
    time.sleep(2 * MONITOR_INTERVAL_S + 0.5)  # and stays so once the monitor has seen the new draft (refused)
    assert not _info(stack).draft_available
    with stack.client() as client:
        plain = client.generate(STORY, max_new_tokens=12, num_speculative_tokens=4)
    assert plain.token_ids == reference and plain.num_draft_tokens == 0

    _restart(stack, 0, service_loop, tokenizer_fingerprint="0" * 64)
    assert eventually(lambda: _refusal(stack) is not None)  # once the gateway has seen the new target
    assert _refusal(stack) == (grpc.StatusCode.UNAVAILABLE, True)
    assert _gateway_health(stack) == health_pb2.HealthCheckResponse.NOT_SERVING

    _restart(stack, 0, service_loop)
    _restart(stack, 1, service_loop)
    assert eventually(lambda: _gateway_health(stack) == health_pb2.HealthCheckResponse.SERVING
                      and _info(stack).draft_available)
    with stack.client() as client:
        assert client.generate(STORY, max_new_tokens=12, num_speculative_tokens=4).token_ids == reference
    stack.wait_until_idle()
