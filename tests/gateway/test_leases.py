"""A gateway killed with SIGKILL leaves no slots behind: they expire with its lease, or its
next start under the same instance name sweeps them at once.

The target and draft run in this process (tests/service_fixtures.py); the gateway runs as
a child process so that it can really be killed mid-stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from specdec.cli.launcher import ServiceProcess, start_service
from specdec.client import build_request
from specdec.v1 import gateway_pb2_grpc
from tests.support.services import Service, StartService

STORY = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]


@pytest.fixture
def gateways() -> Iterator[Callable[..., ServiceProcess]]:
    started: list[ServiceProcess] = []

    def start(target: Service, draft: Service, instance_id: str = "") -> ServiceProcess:
        args = ["--target", f"127.0.0.1:{target.port}", "--draft", f"127.0.0.1:{draft.port}", "--log-level", "WARNING"]
        process = start_service("specdec.gateway", [*args, *(["--instance-id", instance_id] if instance_id else [])])
        started.append(process)
        return process.wait_ready(timeout=120)

    yield start
    for process in started:
        process.stop(grace=2.0)


def _stream_then_kill(gateway: ServiceProcess, services: list[Service]) -> None:
    """Start a long generation, and SIGKILL the gateway once both services hold its slot."""
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


def _wait_until(condition: Callable[[], bool], timeout: float) -> float:
    """Seconds until `condition` held (fails the test after `timeout`)."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, "condition not met in time"
        time.sleep(0.05)
    return time.monotonic() - started


def test_slots_of_a_killed_gateway_expire_with_its_lease(
    start_target: StartService, start_draft: StartService, gateways: Callable[..., ServiceProcess]
) -> None:
    target, draft = start_target(lease_ttl_s=2.0), start_draft(lease_ttl_s=2.0)
    services = [target, draft]
    _stream_then_kill(gateways(target, draft), services)
    assert all(service.engine.tokens for service in services)  # still held right after the kill
    waited = _wait_until(lambda: not target.engine.tokens and not draft.engine.tokens, timeout=10.0)
    assert waited < 2.0 + 1.5  # the TTL plus one expiry check
    for service in services:
        info = service.info()
        assert info.active_slots == 0 and info.free_kv_tokens == info.total_kv_tokens
        assert service.engine.leases.expired_slots_total == 1


def test_a_restarted_gateway_sweeps_the_slots_of_its_previous_run(
    start_target: StartService, start_draft: StartService, gateways: Callable[..., ServiceProcess]
) -> None:
    target, draft = start_target(lease_ttl_s=600.0), start_draft(lease_ttl_s=600.0)
    services = [target, draft]
    _stream_then_kill(gateways(target, draft, instance_id="gw-under-test"), services)
    slots = [next(iter(service.engine.tokens)) for service in services]
    assert all(slot.startswith("gw-under-test/") for slot in slots)  # slot ids carry the instance
    gateways(target, draft, instance_id="gw-under-test")  # ready means its start-up renewal swept
    for service in services:
        assert not service.engine.tokens
        assert service.engine.leases.swept_slots_total == 1 and service.engine.leases.expired_slots_total == 0
