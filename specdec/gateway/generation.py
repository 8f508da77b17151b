"""Serving one request, for every front of the gateway (gRPC `Generate`, the OpenAI-compatible
HTTP routes): validate it, queue it, stream its responses, and free its slots when the client
goes away before the end.

Both fronts describe a request as a `GenerateRequest` and read the same `GenerateResponse`
messages, so validation, limits and the final `Completion` live in one place (`intake`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc

from specdec.errors import DrainingError, ServiceRefusedError
from specdec.gateway.config import GatewayConfig
from specdec.gateway.intake import RequestPolicy, completion_to_pb, new_request, token_logprob_to_pb
from specdec.gateway.monitor import ServiceMonitor
from specdec.gateway.request import Delta, Finished, FinishReason, Request
from specdec.gateway.scheduler import Scheduler
from specdec.gateway.stats import GatewayStats
from specdec.serving.serial_executor import SerialExecutor
from specdec.v1 import gateway_pb2

log = logging.getLogger(__name__)


@dataclass
class GatewayState:
    """Everything the fronts need, built once at start-up."""

    config: GatewayConfig
    policy: RequestPolicy
    scheduler: Scheduler
    stats: GatewayStats
    monitor: ServiceMonitor
    #: Stopping (SIGTERM): new requests are refused, health says so (`Generations.drain`).
    draining: bool = False

    @property
    def target_available(self) -> bool:
        """The target answers its Info polls and serves what the gateway can use."""
        return self.monitor.available["target"] and "target" not in self.monitor.refused

    @property
    def serving(self) -> bool:
        """Whether the gateway takes new requests: its target is available and it is not draining."""
        return self.target_available and not self.draining


class Generation:
    """One queued request: its responses as they come, and how it failed if it did.

    It hears the scheduler through `StreamEvents` (it sets itself as the sequence's `events`)
    and keeps what only a front needs: the queue its handler awaits and the gRPC status of a
    failure. Both calls come from the scheduler's task, on the event loop."""

    def __init__(self, seq: Request) -> None:
        self.seq = seq
        #: What the scheduler streamed and the handler has not read yet; `Finished` comes last.
        self.outbox: asyncio.Queue[Delta | Finished] = asyncio.Queue()
        #: The status a failed request ends with (UNAVAILABLE when the target went down).
        self.error_status = grpc.StatusCode.INTERNAL
        seq.events = self

    def delta(self, delta: Delta) -> None:
        self.outbox.put_nowait(delta)

    def finished(self, finished: Finished) -> None:
        self.error_status = grpc.StatusCode[finished.status]
        self.outbox.put_nowait(finished)

    async def responses(self) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """A message per `Delta`, then the final one carrying the `Completion`."""
        while True:
            event = await self.outbox.get()
            if isinstance(event, Delta):
                yield gateway_pb2.GenerateResponse(token_ids=event.tokens, text=event.text,
                                                   logprobs=[token_logprob_to_pb(t) for t in event.logprobs])
                continue
            yield gateway_pb2.GenerateResponse(completion=completion_to_pb(self.seq, event.error))
            return

    @property
    def failed(self) -> bool:
        return self.seq.finish_reason is FinishReason.ERROR


class Generations:
    """Starts generations for the fronts; owns the tokenizer thread they share."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state
        #: Tokenization and chat rendering run here, off the event loop: a long prompt must not
        #: stall health checks and other streams. One thread, as the tokenizer is not made
        #: for concurrent use.
        self.tokenizer_thread = SerialExecutor("gateway-tokenizer")
        if state.policy.grammars is not None:  # the grammar tokenizer takes seconds: build it now
            self.tokenizer_thread.submit(state.policy.grammars.warm)
        #: Generations between `start` and their end, and whether there are none.
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @asynccontextmanager
    async def start(self, request: gateway_pb2.GenerateRequest) -> AsyncIterator[Generation]:
        """Validate and queue `request` (InvalidArgumentError, RESOURCE_EXHAUSTED when the queue is
        full, UNAVAILABLE while draining or when the target is refused); leaving the block before
        the request finished (the client cancelled or went away) cancels it and frees its slots."""
        if self.state.draining:
            raise DrainingError("the gateway is stopping and takes no new requests: retry on another instance")
        if (refused := self.state.monitor.refused.get("target")) is not None:
            raise ServiceRefusedError(f"the target service is refused: {refused}")
        self.in_flight += 1
        self._idle.clear()
        try:
            seq = await self.tokenizer_thread.run(new_request, request, self.state.policy)
            generation = Generation(seq)  # listens before the scheduler can emit
            self.state.scheduler.submit(seq)
            try:
                yield generation
            finally:
                if not seq.done:
                    self.state.scheduler.cancel(seq)
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.set()

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests (UNAVAILABLE, HTTP 503) and wait up to `timeout_s` for those in
        flight to end; the gateway's stop cancels any still running after it."""
        self.state.draining = True
        started = time.monotonic()
        log.info("draining: %d requests in flight, up to %.0f s to finish; new ones are refused",
                 self.in_flight, timeout_s)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            log.warning("drain: %d requests still running after %.0f s are cancelled", self.in_flight, timeout_s)
        else:
            log.info("drained in %.1f s", time.monotonic() - started)

    def shutdown(self) -> None:
        self.tokenizer_thread.shutdown()
