"""Typed errors shared by the engines.

Each error names the gRPC status it maps to, so the servers can translate with one
small table instead of guessing from messages. Engines raise these; servicers map them.
"""

from __future__ import annotations

#: Trailing metadata key of a refusal for want of room (`CapacityExhaustedError`); its value
#: names what is full. Nothing was changed, so the same call can succeed once room frees up:
#: a gateway that shares a model service with other gateways reads it as "queue or preempt,
#: do not fail" (`specdec.gateway.pools`).
CAPACITY_TRAILER = "specdec-capacity"


class SpecdecError(Exception):
    """Base class of every error an engine raises on purpose (never for bugs)."""

    #: Name of the `grpc.StatusCode` member this error maps to.
    status_code_name: str = "INTERNAL"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata the status carries beside its message (none by default)."""
        return ()


class InvalidArgumentError(SpecdecError, ValueError):
    """Malformed input. `field` is the offending field's path (`stop[3]`, `chat.messages[0].role`,
    `temperature`) when the error is about one, and the message then starts with it. The rule:
    a front reads the field from here, never from the message text, so rewording a message
    cannot change the field a client is told about (`named`)."""

    status_code_name = "INVALID_ARGUMENT"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    def named(self, name: str) -> str:
        """The message with its field called `name` (a front's own name for it); unchanged when
        the message does not start with the field."""
        message = str(self)
        if self.field is None or not message.startswith(self.field):
            return message
        return name + message[len(self.field):]


class SlotNotFoundError(SpecdecError, KeyError):
    """An operation named a slot id the service does not hold."""

    status_code_name = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message
        return str(self.args[0]) if self.args else "slot not found"


class SlotExistsError(SpecdecError):
    """A slot id that is already allocated was allocated again."""

    status_code_name = "ALREADY_EXISTS"


class CapacityExhaustedError(SpecdecError):
    """No room for the request now: `resource` ("kv_blocks", "slots", "queue") is full, and
    nothing was changed. Retryable: its status carries `CAPACITY_TRAILER`."""

    status_code_name = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, *, resource: str) -> None:
        super().__init__(message)
        self.resource = resource

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((CAPACITY_TRAILER, self.resource),)


class ServiceStateError(SpecdecError):
    """A model service's cache length is not what the gateway's bookkeeping expects."""

    status_code_name = "INTERNAL"


class StaleLeaseError(SpecdecError):
    """A lease names an older incarnation of a holder the service has seen restart since."""

    status_code_name = "FAILED_PRECONDITION"


class ServiceRefusedError(SpecdecError):
    """The target came back serving something the gateway cannot use (another tokenizer):
    the gateway serves nothing until it is compatible again or the gateway restarts."""

    status_code_name = "UNAVAILABLE"


class DrainingError(SpecdecError):
    """The server is stopping (SIGTERM): it finishes what it holds and takes nothing new. A
    client retries on another instance."""

    status_code_name = "UNAVAILABLE"
