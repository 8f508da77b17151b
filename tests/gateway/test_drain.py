"""Graceful drain: on SIGTERM a gateway reports NOT_SERVING, refuses new requests with a
retryable status and finishes the streams it holds before it exits; a model service takes no
new slot and waits for the ones gateways hold.

The target and draft run in this process (tests/support/services.py); the gateway runs as a
child process, so that it gets a real SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.client import build_request
from specdec.v1 import common_pb2, gateway_pb2_grpc, target_pb2
from tests.support.services import LoopThread, StartGateway, StartService, eventually, slow_down

STORY = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]
TOKENS = 32


def _streams(address: str, count: int) -> tuple[list[threading.Thread], list[list[int]], list[BaseException]]:
    """`count` greedy streams of `TOKENS` tokens on their own threads: the token ids each got,
    and any error."""
    tokens: list[list[int]] = [[] for _ in range(count)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with grpc.insecure_channel(address) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                for response in stub.Generate(build_request(STORY, max_new_tokens=TOKENS), timeout=300):
                    tokens[i].extend(response.token_ids)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads, tokens, errors


def _refused(address: str) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            for _ in stub.Generate(build_request(STORY, max_new_tokens=4), timeout=60):
                pass
    return refused.value.code()  # type: ignore[no-any-return]


def test_a_gateway_on_sigterm_finishes_its_streams_and_refuses_new_requests(
    start_target: StartService, start_draft: StartService, start_gateway: StartGateway,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    target, draft = start_target(), start_draft()
    slow_down(monkeypatch, target.engine, "verify", 0.05)  # the streams take seconds on any machine
    process = start_gateway(target, draft)
    threads, tokens, errors = _streams(process.address, 2)
    assert eventually(lambda: len(target.engine.tokens) == 2 and all(tokens)), "the streams never started"
    process.process.send_signal(signal.SIGTERM)

    with grpc.insecure_channel(process.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert eventually(lambda: health.Check(health_pb2.HealthCheckRequest()).status
                          == health_pb2.HealthCheckResponse.NOT_SERVING)
    assert _refused(process.address) == grpc.StatusCode.UNAVAILABLE
    assert process.ready is not None and process.ready.http_port is not None
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(f"http://127.0.0.1:{process.ready.http_port}/health", timeout=30)
    assert http.value.code == 503 and http.value.headers["Retry-After"] == "1"

    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert [len(t) for t in tokens] == [TOKENS, TOKENS]  # every admitted stream ran to its end
    assert process.process.wait(timeout=60) == 0  # then the gateway exits by itself
    # Every slot released by the gateway itself, long before its lease could expire (30 s).
    assert eventually(lambda: not target.engine.tokens and not draft.engine.tokens, timeout=3)


def test_a_draining_service_takes_no_new_slot_and_waits_for_those_held(
    start_target: StartService, service_loop: LoopThread,
) -> None:
    target = start_target()

    lease = common_pb2.Lease(holder="gateway-a", incarnation="1")

    def prefill(slot_id: str) -> None:
        item = target_pb2.PrefillItem(slot_id=slot_id, prompt_tokens=[1, 2, 3, 4])
        target.stub.Prefill(target_pb2.PrefillRequest(items=[item], lease=lease))

    prefill("held")
    target.stub.Prefill(target_pb2.PrefillRequest(items=[  # nobody's slot: not waited for
        target_pb2.PrefillItem(slot_id="admin", prompt_tokens=[1, 2])]))
    drained = asyncio.run_coroutine_threadsafe(target.running.drain(), service_loop.loop)
    assert eventually(lambda: target.health.Check(health_pb2.HealthCheckRequest()).status
                      == health_pb2.HealthCheckResponse.NOT_SERVING)
    with pytest.raises(grpc.RpcError) as refused:
        prefill("new")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "no new slots" in (refused.value.details() or "")
    time.sleep(0.5)
    assert not drained.done()  # the held slot is still served, and waited for
    target.stub.Release(common_pb2.ReleaseRequest(slot_id="held"))
    drained.result(timeout=30)
    assert list(target.engine.tokens) == ["admin"]
