"""Typed errors shared by the engines.

Each error names the gRPC status it maps to, so the servers can translate with one
small table instead of guessing from messages. Engines raise these; servicers map them.
"""

from __future__ import annotations


class SpecdecError(Exception):
    """Base class of every error an engine raises on purpose (never for bugs)."""

    #: Name of the `grpc.StatusCode` member this error maps to.
    status_code_name: str = "INTERNAL"


class InvalidArgumentError(SpecdecError, ValueError):
    """Malformed input: the message names the offending field."""

    status_code_name = "INVALID_ARGUMENT"


class SlotNotFoundError(SpecdecError, KeyError):
    """An operation named a slot id the service does not hold."""

    status_code_name = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message
        return str(self.args[0]) if self.args else "slot not found"


class SlotExistsError(SpecdecError):
    """A slot id that is already allocated was allocated again."""

    status_code_name = "ALREADY_EXISTS"


class CapacityExhaustedError(SpecdecError):
    """The KV pool (or slot table) has no room for the request."""

    status_code_name = "RESOURCE_EXHAUSTED"


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
