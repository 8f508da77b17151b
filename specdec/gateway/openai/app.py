"""The aiohttp routes of the OpenAI-compatible front, served on the gateway's event loop.

    POST /v1/chat/completions, POST /v1/completions   (stream: true -> server-sent events)
    GET  /v1/models
    GET  /health                                       (200 while the target serves, else 503; 503 draining)

Requests go through the same `Generations` as gRPC `Generate`, so a client that disconnects
(the handler is cancelled) cancels its request and frees its slots the same way.
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from specdec.errors import SpecdecError
from specdec.gateway.generation import GatewayState, Generation, Generations
from specdec.gateway.openai.errors import ErrorType, OpenAIError, from_exception, from_status
from specdec.gateway.openai.protocol import Endpoint, ServedModel, in_body_terms, parse_request
from specdec.gateway.openai.responses import Reply, is_failure
from specdec.stats import METRICS_CONTENT_TYPE

log = logging.getLogger(__name__)
#: Paths open without the bearer token (load balancers, probes and scrapers), as gRPC health
#: checks and the metrics port are.
OPEN_PATHS = ("/health", "/metrics")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = b"data: [DONE]\n\n"
#: Seconds in-flight requests get to finish when the gateway stops (after its drain).
SHUTDOWN_GRACE_S = 5.0
#: What a retryable refusal (429, 503) tells the client: another instance may take it at once.
RETRY_AFTER = {"Retry-After": "1"}


def dumps(body: object) -> str:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def sse_event(body: object) -> bytes:
    return f"data: {dumps(body)}\n\n".encode()


def error_response(error: OpenAIError) -> web.Response:
    """The error's body and status; a retryable one (429, 503) says when to retry."""
    headers = RETRY_AFTER if error.status in (429, 503) else None
    return web.json_response(error.body(), status=error.status, dumps=dumps, headers=headers)


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure in OpenAI's error shape, aiohttp's own (unknown path, wrong method) too."""
    try:
        return await handler(request)
    except OpenAIError as error:
        return error_response(error)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return error_response(OpenAIError(error.status, f"{request.method} {request.path}: {error.reason}"))
    except Exception as error:  # noqa: BLE001 - this is the mapping layer
        return error_response(from_exception(error))


def bearer_token_check(token: str) -> Middleware:
    """401 for a request without `Authorization: Bearer <token>` (OPEN_PATHS excepted)."""
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), expected):
            raise OpenAIError(401, "missing bearer token" if not given else "wrong bearer token",
                              ErrorType.AUTHENTICATION, code="invalid_api_key")
        return await handler(request)

    return check


class OpenAIFront:
    """The routes' handlers over the gateway's `Generations`."""

    def __init__(self, state: GatewayState, generations: Generations, model: ServedModel,
                 metrics: Callable[[], bytes] | None = None) -> None:
        self.state = state
        #: The gateway's metrics in Prometheus' text format, also served here as vLLM does: an
        #: endpoint picker scrapes the port it routes to.
        self.metrics = metrics
        self.generations = generations
        self.model = model
        self.created = int(time.time())
        #: The gRPC port's limit on a request: larger bodies get 413.
        self.max_request_bytes = state.config.max_request_bytes
        tokenizer = state.policy.tokenizer
        #: Each token's text for logprobs, decoded once: the vocabulary's common tokens recur.
        self.token_text: Callable[[int], str] = functools.lru_cache(maxsize=1 << 16)(
            lambda token_id: str(tokenizer.decode([token_id])))

    def application(self, token: str) -> web.Application:
        middlewares: list[Middleware] = [openai_errors, *([bearer_token_check(token)] if token else [])]
        app = web.Application(middlewares=middlewares, client_max_size=self.max_request_bytes)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        if self.metrics is not None:
            app.router.add_get("/metrics", self.metrics_page)
        return app

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.complete(request, Endpoint.CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.complete(request, Endpoint.COMPLETIONS)

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model.name, "object": "model", "created": self.created, "owned_by": "specdec",
                "max_model_len": self.model.max_model_len}
        return web.json_response({"object": "list", "data": [card]}, dumps=dumps)

    async def health(self, request: web.Request) -> web.Response:
        if self.state.serving:
            return web.json_response({"status": "ok"})
        status = "draining" if self.state.draining else "unavailable"
        return web.json_response({"status": status}, status=503, headers=RETRY_AFTER)

    async def metrics_page(self, request: web.Request) -> web.Response:
        assert self.metrics is not None
        return web.Response(body=self.metrics(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def complete(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        parsed = parse_request(await read_json(request, self.max_request_bytes), endpoint, self.model)
        reply = Reply(parsed, self.model.name, self.token_text)
        try:
            async with self.generations.start(parsed.generate) as generation:
                if parsed.stream:
                    return await stream(request, generation, reply)
                return await answer_whole(generation, reply)
        except SpecdecError as error:  # refused before it was queued: names the field when it can
            param, message = in_body_terms(error, endpoint, parsed.renames)
            raise from_status(grpc.StatusCode[error.status_code_name], message, param) from error


async def read_json(request: web.Request, limit: int) -> Any:
    """The body as JSON; 413 above `limit` bytes, 400 when it is no JSON (or nested past the parser)."""
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large(limit) from None
    try:
        return json.loads(raw)
    except ValueError as error:
        raise OpenAIError(400, f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise OpenAIError(400, "the request body is nested too deeply") from None


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"the request body exceeds the gateway's limit of {limit} bytes",
                       code="request_too_large")


async def answer_whole(generation: Generation, reply: Reply) -> web.Response:
    async for response in generation.responses():
        if is_failure(response):
            raise from_status(generation.error_status, response.completion.error_message)
        reply.add(response)
    return web.json_response(reply.body(), dumps=dumps)


async def stream(request: web.Request, generation: Generation, reply: Reply) -> web.StreamResponse:
    """Server-sent events, `data: [DONE]` last. The headers wait for the first message, so a
    request that fails before its first token still gets its own status (503 when the target is
    down); a failure after it ends the stream with an error event."""
    responses = generation.responses()
    first = await anext(responses)
    if is_failure(first):
        raise from_status(generation.error_status, first.completion.error_message)
    events = web.StreamResponse(headers=SSE_HEADERS)
    try:
        await events.prepare(request)
        await events.write(b"".join(sse_event(chunk) for chunk in reply.chunks(first)))
        async for response in responses:
            if is_failure(response):
                error = from_status(generation.error_status, response.completion.error_message)
                await events.write(sse_event(error.body()))
                break
            await events.write(b"".join(sse_event(chunk) for chunk in reply.chunks(response)))
        await events.write(SSE_DONE)
        await events.write_eof()
    except ConnectionResetError:  # the client went away: leaving `Generations.start` cancels the request
        log.debug("an HTTP stream's client disconnected")
    return events


@dataclass
class HttpServer:
    """The running HTTP front and the port it bound."""

    runner: web.AppRunner
    port: int

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_http(
    front: OpenAIFront, *, host: str, port: int, ssl_context: ssl.SSLContext | None, token: str,
) -> HttpServer:
    """Serve `front` on host:port (0: any free port) with the gRPC port's TLS and token."""
    # handler_cancellation: a client that disconnects cancels its handler, hence its request.
    runner = web.AppRunner(front.application(token), access_log=None, handler_cancellation=True,
                           shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1]
    log.info("serving the OpenAI-compatible HTTP API on %s:%d%s", host, bound, " (TLS)" if ssl_context else "")
    return HttpServer(runner, bound)
