"""Build and run a `grpc.aio` server with health checking, reflection and message limits."""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from specdec.serving.security import TokenCheck
from specdec.wire.keepalive import server_keepalive_options
from specdec.wire.limits import DEFAULT_MAX_MESSAGE_BYTES, message_size_options

log = logging.getLogger(__name__)

#: The current reflection API; grpcio-reflection implements only v1alpha, whose messages are
#: identical on the wire, so the same servicer answers both.
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


class HealthServicer(health.aio.HealthServicer):
    """grpc.health.v1 with `List` (the library's answers UNIMPLEMENTED with a traceback)."""

    def __init__(self) -> None:
        super().__init__()
        self._statuses: dict[str, health_pb2.HealthCheckResponse.ServingStatus.ValueType] = {
            "": health_pb2.HealthCheckResponse.SERVING,
        }

    async def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        self._statuses[service] = status
        await super().set(service, status)

    async def List(self, request: health_pb2.HealthListRequest,
                   context: grpc.aio.ServicerContext) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=status) for name, status in self._statuses.items()}
        )


def enable_reflection(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """Server reflection under both v1alpha and v1 (current grpcurl and grpc-js ask v1 first)."""
    names = [*service_names, reflection.SERVICE_NAME, REFLECTION_V1]
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": handler}),))


#: Called once the server has stopped: release worker threads, channels, schedulers.
StopHook = Callable[[], None | Awaitable[None]]


class RunningServer:
    """A started server, its bound port and its health servicer."""

    def __init__(self, server: grpc.aio.Server, port: int, health_servicer: health.aio.HealthServicer,
                 service_names: Sequence[str], on_stop: StopHook | None,
                 on_drain: Callable[[], None] | None = None) -> None:
        self.server = server
        self.port = port
        self.health = health_servicer
        self.service_names = list(service_names)
        #: Port of the Prometheus /metrics endpoint, for servers that export one.
        self.metrics_port: int | None = None
        #: Port of the OpenAI-compatible HTTP front, for a gateway that serves one.
        self.http_port: int | None = None
        self._on_stop = on_stop
        self._on_drain = on_drain
        #: What a graceful stop waits for once NOT_SERVING (`drain`): the gateway's in-flight
        #: requests, a model service's slots. Set by the server's owner.
        self.finish_work: Callable[[], Awaitable[None]] | None = None

    async def drain(self) -> None:
        """Report NOT_SERVING, so balancers send nothing new, and wait for `finish_work`."""
        await self.health.enter_graceful_shutdown()
        if self.finish_work is not None:
            await self.finish_work()

    async def stop(self, grace: float | None = 5.0) -> None:
        """Report NOT_SERVING, let in-flight RPCs finish for `grace` seconds, then release resources."""
        await self.health.enter_graceful_shutdown()
        if self._on_drain is not None:
            self._on_drain()  # long-lived streams end once idle, rather than at the grace's end
        await self.server.stop(grace)
        if self._on_stop is not None:
            result = self._on_stop()
            if inspect.isawaitable(result):
                await result

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def start_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    *,
    host: str,
    port: int,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    on_stop: StopHook | None = None,
    on_drain: Callable[[], None] | None = None,
    credentials: grpc.ServerCredentials | None = None,
    token: str = "",
    min_ping_interval_s: float | None = None,
) -> RunningServer:
    """Create, register and start a server; `port=0` binds a free port (returned). With
    `credentials` it serves TLS; with `token` every call but health and reflection needs it.
    `on_drain` is called as the stop begins, to end long-lived streams. With
    `min_ping_interval_s` it accepts keepalive pings that often (`specdec.wire.keepalive`);
    without, gRPC's default policy."""
    interceptors = [TokenCheck(token)] if token else []
    options = message_size_options(max_message_bytes)
    if min_ping_interval_s is not None:
        options += server_keepalive_options(min_ping_interval_s)
    server = grpc.aio.server(options=options, interceptors=interceptors)
    register(server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(server, [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name])
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    await server.start()
    for name in ["", *service_names]:  # "" is the whole-server status
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %s on %s:%d", ", ".join(service_names), host, bound)
    return RunningServer(server, bound, health_servicer, service_names, on_stop, on_drain)


async def serve_until_signal(running: RunningServer, grace: float = 5.0) -> None:
    """Block until SIGINT or SIGTERM, then drain (`RunningServer.drain`) and stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received, draining")
    await running.drain()
    log.info("stopping (grace %.1f s)", grace)
    await running.stop(grace)
