"""The streamed work rpcs (VerifyStream, ProposeStream): one exchange after another on a
long-lived stream, each answered as its unary rpc would answer it.

Why streams: a message on an open stream costs the gateway less beyond the service's compute
than a new unary call, and a speculative round makes two such calls
(docs/performance.md#kept-streams).

Each request is counted under its unary rpc's name (`rpc_observer`), so dashboards see
one Verify whichever way it came. An error ends the stream with the unary rpc's status;
the caller opens a new stream for its next request. When the service stops, every stream
that waits for its next request ends at once with status OK (a stream in the middle of a
request answers it first, and any request already received), so a graceful stop does not
sit out its grace period because a gateway is connected.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from specdec.serving.errors import RpcObserver, answer

Req = TypeVar("Req")
Resp = TypeVar("Resp")


async def answer_each(
    context: grpc.aio.ServicerContext, method: str, handle: Callable[[Req], Awaitable[Resp]],
    observer: RpcObserver | None, closing: asyncio.Event,
) -> None:
    """Read requests from the stream of `context` and write `handle(request)` for each, in
    order, until the caller half-closes, an error aborts the stream, or `closing` is set."""
    closed = asyncio.ensure_future(closing.wait())
    try:
        while True:
            read = asyncio.ensure_future(context.read())
            await asyncio.wait((read, closed), return_when=asyncio.FIRST_COMPLETED)
            if not read.done():  # the service is stopping and no request is in flight
                read.cancel()
                return
            request = read.result()
            if request is grpc.aio.EOF:
                return
            response = await answer(
                observer, method, f"{method}Stream", context, lambda: handle(request)  # noqa: B023 - awaited here
            )
            await context.write(response)
    finally:
        closed.cancel()
