"""Keepalive between the gateway's clients and a real service, through a loopback proxy that
can go silent: a connection whose pings go unanswered is closed within seconds (calls fail
UNAVAILABLE instead of waiting out their deadline), and a service accepts pings as often as
its --min-ping-interval-s allows."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
import pytest

from specdec.gateway.model_clients import ServiceLink, TargetClient
from specdec.wire.items import Lease, PrefillItem
from specdec.wire.limits import DEFAULT_MAX_MESSAGE_BYTES
from tests.support.services import LoopThread, Service, slow_down

#: How long the client waits for a ping's answer before it drops the connection.
KEEPALIVE_TIMEOUT_S = 1.0


class SilentProxy:
    """Forwards loopback TCP connections to `upstream_port` until `silence()`; from then on it
    reads and drops every byte both ways and keeps the sockets open, as a peer on a failed
    node or behind a partition looks to TCP."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.connections = 0
        self.silent = threading.Event()
        self._sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def silence(self) -> None:
        self.silent.set()

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._sockets += [client, upstream]
            self.connections += 1
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        while True:
            try:
                data = source.recv(65536)
                if not data:
                    return
                if not self.silent.is_set():
                    sink.sendall(data)
            except OSError:
                return


@contextmanager
def _client_via_proxy(
    service_loop: LoopThread, target: Service, keepalive_s: float
) -> Iterator[tuple[TargetClient, SilentProxy]]:
    proxy = SilentProxy(target.port)

    async def make() -> TargetClient:  # the channel belongs to the loop that uses it
        # A ping's answer may take a second on a loaded machine before the connection is dropped.
        link = ServiceLink(DEFAULT_MAX_MESSAGE_BYTES, keepalive_s=keepalive_s, keepalive_timeout_s=KEEPALIVE_TIMEOUT_S)
        return TargetClient(f"127.0.0.1:{proxy.port}", link, Lease("keepalive-test", "1"))

    client = service_loop.run(make())
    try:
        yield client, proxy
    finally:
        service_loop.run(client.close())
        proxy.close()


def _info_error(service_loop: LoopThread, client: TargetClient, timeout: float) -> tuple[grpc.StatusCode, float]:
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as error:
        service_loop.run(client.info(timeout=timeout))
    return error.value.code(), time.monotonic() - started


def test_a_silent_service_fails_calls_unavailable_within_the_keepalive_timeout(
    service_loop: LoopThread, start_target: Callable[..., Service]
) -> None:
    target = start_target(min_ping_interval_s=0.2)
    with _client_via_proxy(service_loop, target, keepalive_s=0.5) as (client, proxy):
        service_loop.run(client.info(timeout=10))
        time.sleep(2.0)  # pings on an idle connection, at the rate the service accepts
        service_loop.run(client.info(timeout=10))
        assert proxy.connections == 1  # the service kept the connection
        proxy.silence()
        code, _ = _info_error(service_loop, client, timeout=60)
    # UNAVAILABLE: the unanswered pings ended the call. Without them it would end in
    # DEADLINE_EXCEEDED (next test), so the code alone says which, however slow the machine.
    assert code == grpc.StatusCode.UNAVAILABLE


def test_keepalive_does_not_take_a_busy_service_for_a_silent_one(
    service_loop: LoopThread, start_target: Callable[..., Service], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A forward that takes four ping timeouts: gRPC's own threads answer the pings meanwhile.
    target = start_target(min_ping_interval_s=0.2)
    slow_down(monkeypatch, target.engine, "prefill", 4 * KEEPALIVE_TIMEOUT_S)  # on the model worker, as a long forward
    with _client_via_proxy(service_loop, target, keepalive_s=0.5) as (client, proxy):
        result = service_loop.run(client.prefill([PrefillItem("busy", [1, 2, 3])], timeout=20))
        assert "busy" in result.value and proxy.connections == 1


def test_without_keepalive_a_call_to_a_silent_service_waits_out_its_deadline(
    service_loop: LoopThread, start_target: Callable[..., Service]
) -> None:
    target = start_target()
    with _client_via_proxy(service_loop, target, keepalive_s=0) as (client, proxy):
        service_loop.run(client.info(timeout=10))
        proxy.silence()
        code, waited = _info_error(service_loop, client, timeout=3)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and waited >= 3.0


def test_a_service_closes_the_connection_of_a_client_that_pings_more_often_than_it_allows(
    service_loop: LoopThread, start_target: Callable[..., Service]
) -> None:
    target = start_target(min_ping_interval_s=60.0)
    errors: list[grpc.aio.AioRpcError] = []
    with _client_via_proxy(service_loop, target, keepalive_s=0.5) as (client, proxy):
        service_loop.run(client.info(timeout=10))
        # A few pings on an idle connection: strikes, then GOAWAY. The next call fails with
        # the reason while the channel is in its reconnect backoff, or opens a new
        # connection after it; either way the first connection is gone. On a busy machine
        # the strikes may take longer than one idle spell (a call resets them).
        give_up = time.monotonic() + 45.0  # seen: 5-15 s on a 2-core VM under load
        while not errors and proxy.connections == 1 and time.monotonic() < give_up:
            time.sleep(3.0)
            try:
                service_loop.run(client.info(timeout=10))
            except grpc.aio.AioRpcError as error:
                errors.append(error)
        connections = proxy.connections
    assert errors or connections > 1, "the service kept a connection that pinged every 0.5 s (it allows one a minute)"
    for error in errors:  # what a gateway that pings more often than its services allow sees (and logs)
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "ping" in (error.details() or "").lower()
