"""A gateway killed with SIGKILL leaves no slots behind: they expire with its lease, or its
next start under the same instance name sweeps them at once.

The target and draft run in this process (tests/support/services.py); the gateway runs as
a child process so that it can really be killed mid-stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest

from specdec.cli.launcher import ServiceProcess, start_service
from specdec.client import build_request
from specdec.v1 import gateway_pb2_grpc
from tests.support.services import Service, StartService, eventually, slow_down

STORY = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]


@pytest.fixture
def gateways() -> Iterator[Callable[..., ServiceProcess]]:
    started: list[ServiceProcess] = []

    def start(target: Service, draft: Service, instance_id: str = "") -> ServiceProcess:
        args = ["--target", f"127.0.0.1:{target.port}", "--draft", f"127.0.0.1:{draft.port}", "--log-level", "WARNING"]
        process = start_service("specdec.gateway", [*args, *(["--instance-id", instance_id] if instance_id else [])])
        started.append(process)
        return process.wait_ready(timeout=300)  # a cold machine imports torch and loads the tokenizer

    yield start
    for process in started:
        process.stop(grace=2.0)


def _stream_then_kill(gateway: ServiceProcess, services: list[Service], monkeypatch: pytest.MonkeyPatch) -> None:
    """Start a long generation, and SIGKILL the gateway once both services hold its slot
    (each Verify slowed down, so the 400 tokens take seconds on any machine)."""
    slow_down(monkeypatch, services[0].engine, "verify", 0.05)
    with grpc.insecure_channel(gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        stream = stub.Generate(build_request(STORY, max_new_tokens=400, num_speculative_tokens=4), timeout=120)
        for _ in stream:
            if all(service.engine.tokens for service in services):
                gateway.process.kill()
                gateway.process.wait()
                break
        with pytest.raises(grpc.RpcError):
            for _ in stream:
                pass


def test_slots_of_a_killed_gateway_expire_with_its_lease(
    start_target: StartService, start_draft: StartService, gateways: Callable[..., ServiceProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A TTL of twice the gateway's 2-s renewal interval: a live gateway never lapses, and the
    # slots are still held when checked right after the kill, however busy the machine.
    target, draft = start_target(lease_ttl_s=4.0), start_draft(lease_ttl_s=4.0)
    services = [target, draft]
    _stream_then_kill(gateways(target, draft), services, monkeypatch)
    assert all(service.engine.tokens for service in services)  # still held right after the kill
    assert eventually(lambda: not target.engine.tokens and not draft.engine.tokens), "the slots never expired"
    for service in services:
        info = service.info()
        assert info.active_slots == 0 and info.free_kv_tokens == info.total_kv_tokens
        assert service.engine.leases.expired_slots_total == 1


def test_a_restarted_gateway_sweeps_the_slots_of_its_previous_run(
    start_target: StartService, start_draft: StartService, gateways: Callable[..., ServiceProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    target, draft = start_target(lease_ttl_s=600.0), start_draft(lease_ttl_s=600.0)
    services = [target, draft]
    _stream_then_kill(gateways(target, draft, instance_id="gw-under-test"), services, monkeypatch)
    slots = [next(iter(service.engine.tokens)) for service in services]
    assert all(slot.startswith("gw-under-test/") for slot in slots)  # slot ids carry the instance
    gateways(target, draft, instance_id="gw-under-test")  # ready means its start-up renewal swept
    for service in services:
        assert not service.engine.tokens
        assert service.engine.leases.swept_slots_total == 1 and service.engine.leases.expired_slots_total == 0
