"""Transport security and bearer tokens, shared by the three services and their clients.

Everything is off by default (the services bind 127.0.0.1); docs/security.md has the flags.
A server with `--tls-client-ca` demands a client certificate (mutual TLS: the model services
accept only their gateways). With a bearer token, every call but health checks and reflection
(open for load balancers and probes) needs `authorization: Bearer <token>`; the token comes
from a file or the environment, never the command line, where `ps` would show it.

This module imports gRPC only, so the light `specdec health` command can use it.
"""

from __future__ import annotations

import dataclasses
import hmac
import os
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from specdec.errors import InvalidArgumentError
from specdec.flags import option

#: Environment variable read when no token file is given.
TOKEN_ENV = "SPECDEC_AUTH_TOKEN"
#: Method prefixes that never need a token: health checks and server reflection.
OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclasses.dataclass(frozen=True)
class ServerSecurity:
    """How a server proves who it is and whom it lets in (a mixin of the service configs)."""

    tls_cert: str = option("", "PEM certificate chain of this server; with --tls-key, serve TLS instead of plaintext")
    tls_key: str = option("", "PEM private key of --tls-cert")
    tls_client_ca: str = option(
        "", "PEM CA that client certificates must chain to: mutual TLS (needs --tls-cert)", advanced=True,
    )
    auth_token_file: str = option(
        "", f"file holding the bearer token every call must carry (health checks excepted); default ${TOKEN_ENV} if set"
    )

    def check_security(self) -> None:
        """InvalidArgumentError naming the flag when the settings are incomplete or a file is missing."""
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgumentError("tls_cert and tls_key go together: set both or neither", field="tls_cert")
        if self.tls_client_ca and not self.tls_cert:
            raise InvalidArgumentError("tls_client_ca (mutual TLS) needs tls_cert and tls_key", field="tls_client_ca")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file"):
            _check_file(name, getattr(self, name))

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials of the server, or None for plaintext."""
        if not self.tls_cert:
            return None
        client_ca = _read(self.tls_client_ca) if self.tls_client_ca else None
        return grpc.ssl_server_credentials(
            [(_read(self.tls_key), _read(self.tls_cert))], root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )

    def ssl_context(self) -> ssl.SSLContext | None:
        """The same TLS settings for an HTTP server (the gateway's OpenAI front); None for plaintext."""
        if not self.tls_cert:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.tls_cert, self.tls_key)
        if self.tls_client_ca:
            context.load_verify_locations(self.tls_client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def token(self) -> str:
        return read_token(self.auth_token_file)


def _check_file(name: str, path: str) -> None:
    if path and not Path(path).is_file():
        raise InvalidArgumentError(f"{name}: {path!r} is not a readable file", field=name)


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def read_token(path: str = "") -> str:
    """The token in `path` (surrounding whitespace stripped), else `$SPECDEC_AUTH_TOKEN`, else ""."""
    if path:
        token = Path(path).read_text().strip()
        if not token:
            raise InvalidArgumentError(f"auth_token_file: {path!r} is empty", field="auth_token_file")
        return token
    return os.environ.get(TOKEN_ENV, "").strip()


def channel_credentials(ca: str = "", cert: str = "", key: str = "") -> grpc.ChannelCredentials | None:
    """TLS credentials of a client: trust `ca` (the system roots when empty but `cert` is set),
    present `cert`/`key` for mutual TLS. None when no TLS setting is given (plaintext)."""
    if not (ca or cert or key):
        return None
    if bool(cert) != bool(key):
        raise InvalidArgumentError("a client certificate needs both its cert and its key")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca) if ca else None,
        private_key=_read(key) if key else None,
        certificate_chain=_read(cert) if cert else None,
    )


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `token` (empty when there is none)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class TokenCheck(grpc.aio.ServerInterceptor):
    """Answer UNAUTHENTICATED to calls without the bearer token (health and reflection exempt)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = details.method or ""
        if method.startswith(OPEN_METHODS):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        given_bytes = given.encode() if isinstance(given, str) else bytes(given)
        if hmac.compare_digest(given_bytes, self._expected):
            return await continuation(details)
        handler = await continuation(details)
        return _refusal(handler, "missing bearer token" if not given else "wrong bearer token")


def _refusal(handler: grpc.RpcMethodHandler[Any, Any] | None, reason: str) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same kind as `handler` that aborts with UNAUTHENTICATED."""

    async def abort(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    async def abort_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        yield  # pragma: no cover - makes this an async generator

    async def abort_both(requests: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    deserializer = getattr(handler, "request_deserializer", None)
    serializer = getattr(handler, "response_serializer", None)
    if handler is not None and handler.request_streaming:  # the streamed work rpcs are bidirectional
        return grpc.stream_stream_rpc_method_handler(abort_both, deserializer, serializer)
    if handler is not None and handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort_stream, deserializer, serializer)
    return grpc.unary_unary_rpc_method_handler(abort, deserializer, serializer)


def _with_token(details: grpc.aio.ClientCallDetails, token: tuple[tuple[str, str], ...]) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()), *token)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


Continuation = Callable[[grpc.aio.ClientCallDetails, Any], Any]


class _BearerToken:
    """Adds the bearer token to a call's metadata; one subclass per kind of call."""

    def __init__(self, token: str) -> None:
        self._metadata = bearer_metadata(token)

    async def _forward(self, continuation: Continuation, details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        return await continuation(_with_token(details, self._metadata), request)


class _UnaryBearerToken(_BearerToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Continuation, details: grpc.aio.ClientCallDetails,
                                    request: Any) -> Any:
        return await self._forward(continuation, details, request)


class _StreamBearerToken(_BearerToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Continuation, details: grpc.aio.ClientCallDetails,
                                      request_iterator: Any) -> Any:
        return await self._forward(continuation, details, request_iterator)


class _UnaryStreamBearerToken(_BearerToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Continuation, details: grpc.aio.ClientCallDetails,
                                     request: Any) -> Any:
        return await self._forward(continuation, details, request)


class _StreamUnaryBearerToken(_BearerToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Continuation, details: grpc.aio.ClientCallDetails,
                                     request_iterator: Any) -> Any:
        return await self._forward(continuation, details, request_iterator)


def bearer_token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add the bearer token to every call of an aio channel (the gateway
    toward the services): the unary calls, the streamed work rpcs and the KV handoff's
    streams. An aio channel files each interceptor under one kind of call only, hence one per
    kind."""
    return [_UnaryBearerToken(token), _StreamBearerToken(token), _UnaryStreamBearerToken(token),
            _StreamUnaryBearerToken(token)]
