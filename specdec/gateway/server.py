"""The gateway gRPC servicer and its factory.

Start-up connects to the model services (the target, and the draft when there is one), reads
their Info, and refuses to start when the draft's tokenizer differs from the target's (or from
the tokenizer the gateway loaded), or when the configured K exceeds what the services accept.
Without a draft the gateway speculates with lookups alone.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2
from transformers import PreTrainedTokenizerBase

from specdec.cost_model import CostTable
from specdec.errors import InvalidArgumentError, SpecdecError
from specdec.gateway.config import GatewayConfig
from specdec.gateway.deadlines import Deadlines
from specdec.gateway.draft_sources import SpeculationMethod
from specdec.gateway.generation import GatewayState, Generations
from specdec.gateway.info import planner_to_pb
from specdec.gateway.intake import RequestPolicy, method_to_pb
from specdec.gateway.kv_handoff import KVHandoff
from specdec.gateway.metrics import gateway_endpoint
from specdec.gateway.model_clients import INFO_TIMEOUT_S, DraftAPI, DraftClient, ServiceLink, TargetAPI, TargetClient
from specdec.gateway.monitor import ServiceMonitor
from specdec.gateway.openai.app import HttpServer, OpenAIFront, start_http
from specdec.gateway.openai.protocol import ServedModel
from specdec.gateway.planner import Planner
from specdec.gateway.pools import PoolLimits
from specdec.gateway.proposers import LookupProposer
from specdec.gateway.scheduler import Scheduler
from specdec.gateway.service_changes import ServiceChanges
from specdec.gateway.stats import GatewayStats
from specdec.gateway.tools import ToolFormat, choose_format
from specdec.grammar import GrammarCompiler
from specdec.model.loader import load_tokenizer
from specdec.model.tokenizer_info import check_compatible, tokenizer_fingerprint
from specdec.serving.errors import grpc_errors, grpc_stream_errors
from specdec.serving.grpc_server import RunningServer, start_server
from specdec.serving.security import channel_credentials, read_token
from specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from specdec.wire.items import Lease
from specdec.wire.model_info import ModelInfo

log = logging.getLogger(__name__)
SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, state: GatewayState, generations: Generations) -> None:
        self.state = state
        self.generations = generations

    @grpc_errors
    async def Info(self, request: common_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> gateway_pb2.GatewayInfo:
        s = self.state  # answered from the monitor's latest Info: never waits on a service
        info = gateway_pb2.GatewayInfo(
            target=s.monitor.latest["target"].to_pb(),
            target_available=s.monitor.available["target"],
            speculative_enabled=s.config.speculative,
            default_num_speculative_tokens=s.policy.num_speculative_tokens,
            max_speculative_tokens=s.policy.max_speculative_tokens,
            default_max_new_tokens=s.config.default_max_new_tokens,
            adaptive_k=s.config.adaptive_k and s.scheduler.planner.can_adapt,
            default_speculation_method=method_to_pb(s.policy.default_method),
            planner=planner_to_pb(s.stats.planner),
        )
        if "draft" in s.monitor.latest:
            info.draft.CopyFrom(s.monitor.latest["draft"].to_pb())
            info.draft_available = s.monitor.available["draft"] and not s.scheduler.draft_degraded
        return info

    @grpc_stream_errors
    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        async with self.generations.start(request) as generation:
            async for response in generation.responses():
                yield response
            if generation.failed:
                await context.abort(generation.error_status, response.completion.error_message)


def new_lease(config: GatewayConfig) -> Lease:
    """This start of this gateway: its stable instance name and a fresh, time-ordered incarnation."""
    holder = config.instance_id or (
        f"{socket.gethostname()}:{config.port}" if config.port else f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    )
    return Lease(holder, f"{time.time_ns():x}-{uuid.uuid4().hex[:6]}")


async def create_gateway(config: GatewayConfig) -> RunningServer:
    """Connect to the model services, check them, start the scheduler and the servers (gRPC, and
    the OpenAI-compatible HTTP front when `http_port` is set)."""
    services = await connect_services(config)
    tokenizer = check_services(config, services)
    stats = GatewayStats(services.max_speculative_tokens)
    scheduler = new_scheduler(config, services, stats)
    monitor = ServiceMonitor(services.clients(), services.infos(), stats)
    policy = new_policy(config, services, tokenizer)
    state = GatewayState(config, policy, scheduler, stats, monitor)
    generations = Generations(state)
    servicer = GatewayServicer(state, generations)
    scheduler.start()
    endpoint = gateway_endpoint(stats, services.target_info.model_name, config.metrics_prefix)
    http: list[HttpServer] = []

    async def close() -> None:
        for server in http:  # first: its streams end before the scheduler stops
            await server.stop()
        await monitor.stop()
        await scheduler.stop()
        await asyncio.to_thread(generations.shutdown)
        await services.close()
        endpoint.close()

    try:
        running = await start_server(
            lambda server: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server),
            [SERVICE_NAME], host=config.host, port=config.port, max_message_bytes=config.max_request_bytes,
            on_stop=close, credentials=config.server_credentials(), token=config.token(),
        )
    except BaseException:  # e.g. the port is taken: stop what was started
        await close()
        raise
    if config.http_port >= 0:
        model = served_model(services, choose_format(tokenizer, config.tool_call_parser))
        try:
            http.append(await start_http(
                OpenAIFront(state, generations, model, endpoint.exposition), host=config.host, port=config.http_port,
                ssl_context=config.ssl_context(), token=config.token(),
            ))
        except BaseException:
            await running.stop(grace=0)  # which closes the rest
            raise
        running.http_port = http[0].port
    watch_services(config, services, monitor, scheduler, running)
    running.finish_work = lambda: generations.drain(config.drain_timeout_s)
    if config.metrics_port >= 0:
        running.metrics_port = endpoint.serve(config.metrics_port, config.host)
    return running


def served_model(services: Services, tool_format: ToolFormat) -> ServedModel:
    """The target as the HTTP front names it: by its model name, or the id it was loaded from."""
    info = services.target_info
    return ServedModel(info.model_name, frozenset({info.model_name, info.model_id}), services.max_seq_len,
                       tool_format)


@dataclass(frozen=True)
class Services:
    """The gateway's clients of its model services and what their Info said at start-up."""

    lease: Lease
    target: TargetClient
    target_info: ModelInfo
    draft: DraftClient | None = None
    draft_info: ModelInfo | None = None

    def clients(self) -> dict[str, TargetAPI | DraftAPI]:
        return {"target": self.target, **({"draft": self.draft} if self.draft is not None else {})}

    def infos(self) -> dict[str, ModelInfo]:
        return {"target": self.target_info, **({"draft": self.draft_info} if self.draft_info is not None else {})}

    @property
    def max_speculative_tokens(self) -> int:
        return min(info.max_speculative_tokens for info in self.infos().values())

    @property
    def max_seq_len(self) -> int:
        return min(info.max_seq_len for info in self.infos().values())

    @property
    def costs_known(self) -> bool:
        """Every service advertised its forward costs: the K planner can adapt."""
        return all(info.forward_costs for info in self.infos().values())

    async def close(self) -> None:
        await self.target.close()
        if self.draft is not None:
            await self.draft.close()


async def connect_services(config: GatewayConfig) -> Services:
    """Clients of both services, their Info, and this gateway's lease renewed on each (which
    frees what an earlier run of this gateway left there)."""
    lease = new_lease(config)
    link = ServiceLink(
        config.max_message_bytes,
        channel_credentials(config.service_tls_ca, config.service_tls_cert, config.service_tls_key),
        read_token(config.service_auth_token_file),
        streamed=config.streamed_calls,
        keepalive_s=config.keepalive_s,
        keepalive_timeout_s=config.keepalive_timeout_s,
    )
    target = TargetClient(config.target_address, link, lease)
    probs_dtype = common_pb2.DTYPE_BFLOAT16 if config.draft_probs_dtype == "bfloat16" else common_pb2.DTYPE_FLOAT32
    draft = DraftClient(config.draft_address, link, probs_dtype, lease) if config.draft_address else None
    services = Services(lease, target, await target.info(), draft, await draft.info() if draft is not None else None)
    for name, service in services.clients().items():
        if swept := await service.renew_lease(timeout=INFO_TIMEOUT_S):
            log.warning("the %s freed %d slot(s) of this gateway's previous run (%s)", name, swept, lease.holder)
    return services


def check_services(config: GatewayConfig, services: Services) -> PreTrainedTokenizerBase:
    """The target's tokenizer, loaded here; refuses a draft with another tokenizer, a tokenizer
    that differs from the target's own, or a K above what the services accept."""
    target_info = services.target_info
    tokenizer = load_tokenizer(target_info.model_id)
    if tokenizer_fingerprint(tokenizer) != target_info.tokenizer.fingerprint:
        raise SpecdecError(f"the gateway's tokenizer for {target_info.model_id!r} differs from the target's")
    if services.draft_info is not None:
        check_compatible(services.draft_info.tokenizer, target_info.tokenizer)
    limit = services.max_speculative_tokens
    if config.speculative and config.num_speculative_tokens > limit:
        raise InvalidArgumentError(f"num_speculative_tokens {config.num_speculative_tokens} exceeds the services' "
                                   f"maximum {limit}", field="num_speculative_tokens")
    return tokenizer


def new_scheduler(config: GatewayConfig, services: Services, stats: GatewayStats) -> Scheduler:
    target_costs, draft_info = services.target_info.forward_costs, services.draft_info
    draft_costs = draft_info.forward_costs if draft_info is not None else ()
    planner = Planner(list(target_costs), list(draft_costs) if config.adaptive_k else [],
                       uses_draft=services.draft is not None, guesses=config.lookup_guesses,
                       kv_handoff=KVHandoff.between(services.target_info, draft_info) if config.kv_handoff else None)
    for name, info in services.infos().items():
        planner.note_service(name, info.pending_graphs)
    if planner.kv_handoff is not None:
        log.info("the draft's KV cache is filled from the target's (%d layers, %s)",
                 planner.kv_handoff.num_layers, str(planner.kv_handoff.dtype).removeprefix("torch."))
    pools = [PoolLimits(name, info.total_kv_tokens, info.block_size, info.max_slots)
             for name, info in services.infos().items()]
    return Scheduler(
        services.target, services.draft, pools, max_seq_len=services.max_seq_len, max_batch_size=config.max_batch_size,
        max_queue=config.max_queue, planner=planner, stats=stats,
        # A target that comes back allowing less than the promised K is refused (`service_changes`),
        # so steps within it stay valid whatever target answers.
        decode_steps=min(config.decode_steps, services.max_speculative_tokens + 1),
        lookup=LookupProposer(config.lookup_settings()), grammar_drafts=config.grammar_drafts,
        deadlines=Deadlines(
            config.rpc_timeout_floor_s, config.rpc_timeout_factor,
            CostTable(target_costs) if target_costs else None, CostTable(draft_costs) if draft_costs else None,
            loading=frozenset(name for name, info in services.infos().items() if info.pending_graphs > 0),
        ),
    )


def new_policy(config: GatewayConfig, services: Services, tokenizer: PreTrainedTokenizerBase) -> RequestPolicy:
    info, lease = services.target_info, services.lease
    return RequestPolicy(
        tokenizer=tokenizer, vocab_size=info.tokenizer.vocab_size,
        eos_token_ids=frozenset(info.tokenizer.eos_token_ids),
        max_seq_len=services.max_seq_len, max_speculative_tokens=services.max_speculative_tokens,
        has_draft=services.draft is not None, speculative=config.speculative,
        num_speculative_tokens=config.k_for(services.max_speculative_tokens, services.costs_known),
        adaptive_k=config.adaptive_k, reserve_kv_growth=config.reserve_kv_growth,
        default_max_new_tokens=config.default_max_new_tokens, slot_prefix=f"{lease.holder}/{lease.incarnation}/",
        default_method=SpeculationMethod(config.speculation_method),
        grammars=GrammarCompiler(tokenizer, info.tokenizer.vocab_size, sorted(info.tokenizer.eos_token_ids)),
    )


def watch_services(
    config: GatewayConfig, services: Services, monitor: ServiceMonitor, scheduler: Scheduler, running: RunningServer
) -> None:
    """Start polling the services: the gateway's health follows the target's, and a service that
    comes back changed is adopted or refused (`ServiceChanges`)."""

    async def report_target(available: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if available else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await running.health.set(name, status)
        if available:
            scheduler.wake()  # requests that lost the target resume now, not at the next retry

    monitor.on_target = report_target
    planner = scheduler.planner

    def note_info(name: str, info: ModelInfo) -> None:
        """A service still loading compiled graphs: timings not learnt from, calls given longer."""
        planner.note_service(name, info.pending_graphs)
        scheduler.deadlines = scheduler.deadlines.with_loading(name, info.pending_graphs > 0)

    monitor.on_info = note_info
    monitor.on_back = planner.service_restarted
    # Lookups speculate without a draft, so the target's K is promised either way.
    max_k = services.max_speculative_tokens
    monitor.on_change = ServiceChanges(
        scheduler, services.target_info.tokenizer, max_k, services.max_seq_len, config.adaptive_k,
        config.kv_handoff, dict(services.infos()),
    )
    monitor.start()
