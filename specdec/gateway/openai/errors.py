"""Failures in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the
HTTP status that matches the gateway's gRPC status for the same failure."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

import grpc

from specdec.errors import SpecdecError

log = logging.getLogger(__name__)


class ErrorType(enum.Enum):
    """OpenAI's `error.type` values the front answers with."""

    INVALID_REQUEST = "invalid_request_error"
    AUTHENTICATION = "authentication_error"
    RATE_LIMIT = "rate_limit_error"
    SERVER = "server_error"


@dataclass(eq=False)  # not frozen: raising sets attributes (`__traceback__`) on an exception
class OpenAIError(Exception):
    """A failure to answer with `status` and OpenAI's error body. `param` names the request
    field at fault (OpenAI's dotted / indexed path, e.g. `messages[1].role`)."""

    status: int
    message: str
    type: ErrorType = ErrorType.INVALID_REQUEST
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type.value, "param": self.param, "code": self.code}}


def invalid_field(param: str, message: str) -> OpenAIError:
    """400 for a field the request got wrong; the message starts with the field's name."""
    return OpenAIError(400, f"{param}: {message}", param=param)


def not_supported(param: str, reason: str = "not supported by this server") -> OpenAIError:
    """400 for a field this server does not implement (never ignored: the client would get
    something other than what it asked for)."""
    return OpenAIError(400, f"{param}: {reason}", param=param, code="unsupported_parameter")


#: The HTTP status, error type and code of each gRPC status a generation can end with.
_FROM_GRPC: dict[grpc.StatusCode, tuple[int, ErrorType, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, ErrorType.INVALID_REQUEST, None),
    grpc.StatusCode.UNAUTHENTICATED: (401, ErrorType.AUTHENTICATION, "invalid_api_key"),
    grpc.StatusCode.NOT_FOUND: (404, ErrorType.INVALID_REQUEST, None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, ErrorType.RATE_LIMIT, "queue_full"),
    grpc.StatusCode.UNAVAILABLE: (503, ErrorType.SERVER, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, ErrorType.SERVER, "timeout"),
}


def from_status(status: grpc.StatusCode, message: str, param: str | None = None) -> OpenAIError:
    """The error of a generation that ended with the gRPC `status` (500 for any other)."""
    http_status, error_type, code = _FROM_GRPC.get(status, (500, ErrorType.SERVER, None))
    return OpenAIError(http_status, message, error_type, param if http_status == 400 else None, code)


def from_exception(error: Exception) -> OpenAIError:
    """An engine error keeps its status and message; anything else is a bug: 500, logged here
    with its traceback, which never reaches the client."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, SpecdecError):
        return from_status(grpc.StatusCode[error.status_code_name], str(error))
    log.exception("HTTP request failed", exc_info=error)
    return OpenAIError(500, f"internal error ({type(error).__name__}); see the server log", ErrorType.SERVER)
