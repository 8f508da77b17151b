"""Serving one request, for every front of the gateway (gRPC `Generate`, the OpenAI-compatible
HTTP routes): validate it, queue it, stream its responses, and free its slots when the client
goes away before the end.

Both fronts describe a request as a `GenerateRequest` and read the same `GenerateResponse`
messages, so validation, limits and the final `Completion` live in one place (`requests`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc

from specdec.errors import ServiceRefusedError
from specdec.gateway.config import GatewayConfig
from specdec.gateway.model_clients import DraftAPI, TargetAPI
from specdec.gateway.monitor import ServiceMonitor
from specdec.gateway.requests import RequestPolicy, completion_to_pb, new_sequence, token_logprob_to_pb
from specdec.gateway.scheduler import Scheduler
from specdec.gateway.sequence import Delta, FinishReason, Sequence
from specdec.gateway.stats import GatewayStats
from specdec.serving.worker import ModelWorker
from specdec.v1 import gateway_pb2


@dataclass
class GatewayState:
    """Everything the fronts need, built once at start-up."""

    config: GatewayConfig
    target: TargetAPI
    draft: DraftAPI | None
    policy: RequestPolicy
    scheduler: Scheduler
    stats: GatewayStats
    monitor: ServiceMonitor

    @property
    def target_available(self) -> bool:
        """The target answers its Info polls and serves what the gateway can use."""
        return self.monitor.available["target"] and "target" not in self.monitor.refused


class Generation:
    """One queued request: its responses as they come, and how it failed if it did."""

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq

    async def responses(self) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """A message per `Delta`, then the final one carrying the `Completion`."""
        while True:
            event = await self.seq.outbox.get()
            if isinstance(event, Delta):
                yield gateway_pb2.GenerateResponse(token_ids=event.tokens, text=event.text,
                                                   logprobs=[token_logprob_to_pb(t) for t in event.logprobs])
                continue
            yield gateway_pb2.GenerateResponse(completion=completion_to_pb(self.seq, event.error))
            return

    @property
    def failed(self) -> bool:
        return self.seq.finish_reason is FinishReason.ERROR

    @property
    def error_status(self) -> grpc.StatusCode:
        """The status a failed request ends with (UNAVAILABLE when the target went down)."""
        return self.seq.error_status


class Generations:
    """Starts generations for the fronts; owns the tokenizer thread they share."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state
        #: Tokenization and chat rendering run here, off the event loop: a long prompt must not
        #: stall health checks and other streams. One thread, as the tokenizer is not made
        #: for concurrent use.
        self.tokenizer_thread = ModelWorker("gateway-tokenizer")
        if state.policy.grammars is not None:  # the grammar tokenizer takes seconds: build it now
            self.tokenizer_thread.submit(state.policy.grammars.warm)

    @asynccontextmanager
    async def start(self, request: gateway_pb2.GenerateRequest) -> AsyncIterator[Generation]:
        """Validate and queue `request` (InvalidArgumentError, RESOURCE_EXHAUSTED when the queue is
        full, UNAVAILABLE when the target is refused); leaving the block before the request
        finished (the client cancelled or went away) cancels it and frees its slots."""
        if (refused := self.state.monitor.refused.get("target")) is not None:
            raise ServiceRefusedError(f"the target service is refused: {refused}")
        seq = await self.tokenizer_thread.run(new_sequence, request, self.state.policy)
        self.state.scheduler.submit(seq)
        try:
            yield Generation(seq)
        finally:
            if not seq.done:
                self.state.scheduler.cancel(seq)

    def shutdown(self) -> None:
        self.tokenizer_thread.shutdown()
