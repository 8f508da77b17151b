"""Request → response exchanges on one long-lived bidirectional stream (the services'
VerifyStream and ProposeStream), for the gateway's two calls of every round.

A message on an open stream costs less than a new unary call (`specdec.serving.streams`,
docs/performance.md#kept-streams).

The stream is opened on first use and kept. Whatever ends an exchange early (an error
status, the deadline, the caller's cancellation) ends the stream with it, since its next
answer could belong to the abandoned request; the next exchange opens a new one. Errors
look as the unary call's would: the service's status as `grpc.aio.AioRpcError`, and
DEADLINE_EXCEEDED when `timeout` passes. An exchange that finds the previous one still
under way (the scheduler never overlaps them, but nothing forbids it) makes the unary
call instead of waiting its turn, and so does one whose stream the service ended between
requests because it is stopping: the unary call then meets the service as it now is.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import grpc

Req = TypeVar("Req")
Resp = TypeVar("Resp")


def deadline_exceeded(timeout: float) -> grpc.aio.AioRpcError:
    """The error a unary call raises when its deadline passes."""
    empty = grpc.aio.Metadata()
    return grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, empty, empty, f"no answer within {timeout:.3g} s")


class StreamedRpc(Generic[Req, Resp]):
    """`await rpc(request, timeout)`: one exchange on the kept stream (see the module docstring)."""

    def __init__(
        self, open_stream: Callable[[], Any], unary: Callable[[Req, float], Awaitable[Resp]]
    ) -> None:
        #: Opens the bidirectional call (a stub's stream-stream method, called without requests).
        self._open = open_stream
        self._unary = unary
        self._call: Any = None  # grpc.aio.StreamStreamCall once open
        self._busy = False

    async def __call__(self, request: Req, timeout: float) -> Resp:
        if self._busy:
            return await self._unary(request, timeout)
        self._busy = True
        try:
            return await self._exchange(request, timeout)
        finally:
            self._busy = False

    async def _exchange(self, request: Req, timeout: float) -> Resp:
        started = time.monotonic()
        if self._call is None or self._call.done():
            self._call = self._open()
        call = self._call
        try:
            async with asyncio.timeout(timeout):
                await call.write(request)
                response = await call.read()
        except TimeoutError:
            self._end(call)
            raise deadline_exceeded(timeout) from None
        except asyncio.InvalidStateError:  # it ended before the request went out
            response = grpc.aio.EOF
        except BaseException:
            self._end(call)
            raise
        if response is grpc.aio.EOF:  # ended with status OK between requests: the service is stopping
            self._end(call)
            return await self._unary(request, max(0.0, timeout - (time.monotonic() - started)))
        return response

    def _end(self, call: Any) -> None:
        call.cancel()
        if self._call is call:
            self._call = None
