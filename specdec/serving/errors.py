"""One error-mapping layer from engine exceptions to gRPC status codes.

Engines raise `specdec.errors.SpecdecError` subclasses for expected failures; those map
to their declared status with their message. Anything else is a bug: INTERNAL, with the
traceback logged here (never sent to the client).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

import grpc

from specdec.errors import SpecdecError

log = logging.getLogger(__name__)
T = TypeVar("T")


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and client-facing message for an exception."""
    if isinstance(error, SpecdecError):
        return grpc.StatusCode[error.status_code_name], str(error)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(error).__name__}); see the server log"


async def _abort(context: grpc.aio.ServicerContext, error: Exception, method: str) -> None:
    code, message = status_of(error)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method, exc_info=error)
    else:
        log.info("%s: %s: %s", method, code.name, message)
    trailers = error.trailing_metadata() if isinstance(error, SpecdecError) else ()
    await context.abort(code, message, trailing_metadata=trailers)


class RpcObserver(Protocol):
    """Told how every rpc ended (the model services' `ServiceStats`)."""

    def record_rpc(self, method: str, seconds: float, code: str) -> None: ...


async def answer(
    observer: RpcObserver | None, method: str, qualname: str, context: grpc.aio.ServicerContext,
    handle: Callable[[], Awaitable[T]],
) -> T:
    """Await `handle()` as the rpc `method`: an engine error aborts the call with its precise
    gRPC status, and `observer` (if any) is told the latency and status."""
    started = time.perf_counter()

    def record(code: str) -> None:
        # Before the status leaves: a client that scrapes right after its error must see it.
        if observer is not None:
            observer.record_rpc(method, time.perf_counter() - started, code)

    try:
        result = await handle()
    except (grpc.aio.AbortError, grpc.aio.UsageError):
        record("UNKNOWN")
        raise
    except Exception as error:  # noqa: BLE001 - this is the mapping layer
        record(status_of(error)[0].name)
        await _abort(context, error, qualname)
        raise  # unreachable: abort raises
    except BaseException:  # cancelled by the client or at shutdown
        record("CANCELLED")
        raise
    record("OK")
    return result


def grpc_errors(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Decorate a unary servicer method so engine errors become precise gRPC statuses.

    A servicer with an `rpc_observer` attribute is told each call's latency and status.
    """

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        observer: RpcObserver | None = getattr(self, "rpc_observer", None)
        return await answer(
            observer, method.__name__, method.__qualname__, context, lambda: method(self, request, context)
        )

    return wrapper


def grpc_stream_errors(method: Callable[..., AsyncIterator[T]]) -> Callable[..., AsyncIterator[T]]:
    """Like `grpc_errors`, for server-streaming methods (async generators)."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[T]:
        try:
            async for item in method(self, request, context):
                yield item
        except (grpc.aio.AbortError, grpc.aio.UsageError):
            raise
        except Exception as error:  # noqa: BLE001 - this is the mapping layer
            await _abort(context, error, method.__qualname__)

    return wrapper
