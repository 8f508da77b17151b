"""Gateway configuration, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.errors import InvalidArgumentError
from specdec.serving.grpc_server import DEFAULT_MAX_MESSAGE_BYTES


@dataclass(frozen=True)
class GatewayConfig:
    """Where the model services are, how the gateway speculates and how much it admits."""

    target_address: str
    #: Draft service address; empty runs the gateway without speculation.
    draft_address: str = ""
    host: str = "127.0.0.1"
    port: int = 50050
    #: Speculate by default (requests may opt out).
    speculative: bool = True
    #: Draft tokens per round (K) unless a request asks for another value; with adaptive_k,
    #: the largest K the planner may choose.
    spec_length: int = 4
    #: Choose K in 0..spec_length per request and round from the services' measured costs
    #: and the observed acceptance (0 when speculation does not pay, e.g. in crowded rounds
    #: on a compute-bound target). Off: every round drafts spec_length tokens.
    adaptive_k: bool = True
    max_new_tokens_default: int = 256
    #: Requests decoding at once; more wait in the queue.
    max_batch_size: int = 16
    #: Requests waiting for admission; beyond this Generate answers RESOURCE_EXHAUSTED.
    max_queue: int = 64
    #: Wire precision of the draft's q vectors ("float32" or "bfloat16"); exact either way.
    draft_probs_dtype: str = "float32"
    #: Port of the Prometheus /metrics HTTP endpoint; -1 disables it, 0 picks a free port.
    metrics_port: int = -1
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def __post_init__(self) -> None:
        if not self.target_address:
            raise InvalidArgumentError("target_address is required")
        if self.speculative and not self.draft_address:
            raise InvalidArgumentError("speculation requires a draft: set draft_address or disable speculation")
        if self.spec_length < 1:
            raise InvalidArgumentError(f"spec_length must be >= 1, got {self.spec_length}")
        for name in ("max_new_tokens_default", "max_batch_size", "max_queue", "max_message_bytes"):
            if getattr(self, name) <= 0:
                raise InvalidArgumentError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.draft_probs_dtype not in ("float32", "bfloat16"):
            raise InvalidArgumentError(f"draft_probs_dtype must be float32 or bfloat16, got {self.draft_probs_dtype!r}")
        if not 0 <= self.port <= 65535 or not -1 <= self.metrics_port <= 65535:
            raise InvalidArgumentError("port and metrics_port must be valid port numbers")
