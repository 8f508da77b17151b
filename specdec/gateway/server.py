"""The gateway gRPC servicer and its factory.

Start-up connects to both model services, reads their Info, and refuses to start when the
draft's tokenizer differs from the target's (or from the tokenizer the gateway loaded),
or when the configured K exceeds what the services accept.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from transformers import PreTrainedTokenizerBase

from specdec.errors import InvalidArgumentError, SpecdecError
from specdec.gateway.config import GatewayConfig
from specdec.gateway.detokenizer import StopStringDetokenizer
from specdec.gateway.k_planner import KPlanner
from specdec.gateway.metrics import GatewayMetrics
from specdec.gateway.model_clients import DraftClient, TargetClient
from specdec.gateway.scheduler import PoolLimits, Scheduler, check_prompt
from specdec.gateway.sequence import Delta, FinishReason, Sequence
from specdec.model.chat import encode_chat
from specdec.model.loader import load_tokenizer
from specdec.model.tokenizer_info import TokenizerInfo, check_compatible, tokenizer_fingerprint
from specdec.sampling.params import independent_seed
from specdec.sampling.transforms import make_generator
from specdec.serving.convert import forward_costs_from_pb, sampling_from_pb
from specdec.serving.errors import grpc_errors, grpc_stream_errors
from specdec.serving.grpc_server import RunningServer, start_server
from specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

log = logging.getLogger(__name__)
#: Random stream of the draft's proposals (see `independent_seed`).
DRAFT_STREAM = 1
SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
_FINISH_TO_PB = {
    FinishReason.STOP: gateway_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: gateway_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: gateway_pb2.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: gateway_pb2.FINISH_REASON_ERROR,
}


def _tokenizer_info(info: common_pb2.ModelInfo) -> TokenizerInfo:
    return TokenizerInfo(info.vocab_size, tuple(sorted(info.eos_token_ids)), info.tokenizer_fingerprint)


@dataclass
class GatewayState:
    """Everything the servicer needs, built once at start-up."""

    config: GatewayConfig
    target: TargetClient
    draft: DraftClient | None
    target_info: common_pb2.ModelInfo
    draft_info: common_pb2.ModelInfo | None
    tokenizer: PreTrainedTokenizerBase
    scheduler: Scheduler
    metrics: GatewayMetrics
    max_seq_len: int
    max_speculative_tokens: int


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, state: GatewayState) -> None:
        self.state = state

    @grpc_errors
    async def Info(self, request: common_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> gateway_pb2.GatewayInfo:
        s = self.state
        info = gateway_pb2.GatewayInfo(
            target=await s.target.info(),
            speculative_enabled=s.config.speculative,
            default_num_speculative_tokens=s.config.num_speculative_tokens,
            max_speculative_tokens=s.max_speculative_tokens,
            max_new_tokens_default=s.config.max_new_tokens_default,
            adaptive_k=s.config.adaptive_k and s.scheduler.planner.can_adapt,
        )
        if s.draft is not None:
            info.draft.CopyFrom(await s.draft.info())
        return info

    @grpc_stream_errors
    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        seq = self._new_sequence(request)
        self.state.scheduler.submit(seq)
        try:
            while True:
                event = await seq.outbox.get()
                if isinstance(event, Delta):
                    yield gateway_pb2.GenerateResponse(token_ids=event.tokens, text=event.text)
                    continue
                yield gateway_pb2.GenerateResponse(completion=self._completion(seq, event.error))
                if event.reason == FinishReason.ERROR:
                    await context.abort(seq.error_status, event.error)
                return
        finally:
            if not seq.done:  # the client went away (cancelled or deadline): free its slots
                self.state.scheduler.cancel(seq)

    def _new_sequence(self, request: gateway_pb2.GenerateRequest) -> Sequence:
        s = self.state
        which = request.WhichOneof("input")
        if which == "prompt":
            prompt = list(s.tokenizer(request.prompt)["input_ids"])
        elif which == "chat":
            prompt = encode_chat(s.tokenizer, [{"role": m.role, "content": m.content} for m in request.chat.messages])
        else:
            raise InvalidArgumentError("input: set either prompt or chat")
        check_prompt(prompt, s.max_seq_len, s.target_info.vocab_size)
        if request.max_new_tokens < 0:
            raise InvalidArgumentError(f"max_new_tokens: must be >= 0, got {request.max_new_tokens}")
        sampling = sampling_from_pb(request.sampling)
        spec = request.speculation
        speculate = spec.enabled if spec.HasField("enabled") else s.config.speculative
        if speculate and s.draft is None:
            raise InvalidArgumentError("speculation.enabled: this gateway runs without a draft model")
        num_speculative_tokens = spec.num_speculative_tokens if spec.HasField("num_speculative_tokens") else s.config.num_speculative_tokens
        adaptive = spec.adaptive if spec.HasField("adaptive") else s.config.adaptive_k and not spec.HasField("num_speculative_tokens")
        if speculate and not 1 <= num_speculative_tokens <= s.max_speculative_tokens:
            raise InvalidArgumentError(f"speculation.num_speculative_tokens: {num_speculative_tokens} is outside [1, {s.max_speculative_tokens}]")
        eos = set(s.target_info.eos_token_ids)
        return Sequence(
            slot_id=uuid.uuid4().hex,
            prompt=prompt,
            sampling=sampling,
            max_new_tokens=request.max_new_tokens or s.config.max_new_tokens_default,
            num_speculative_tokens=num_speculative_tokens if speculate else 0,
            adaptive=adaptive,
            detokenizer=StopStringDetokenizer(s.tokenizer, list(request.stop), eos),
            generator=make_generator(sampling.seed, "cpu"),
            draft_sampling=dataclasses.replace(
                sampling, seed=None if sampling.seed is None else independent_seed(sampling.seed, DRAFT_STREAM)
            ),
        )

    @staticmethod
    def _completion(seq: Sequence, error: str) -> gateway_pb2.Completion:
        ttft = (seq.first_token_at or seq.finished_at or seq.created_at) - seq.created_at
        total = (seq.finished_at or seq.created_at) - seq.created_at
        decode_time = total - ttft
        rate = (seq.completion_tokens - 1) / decode_time if seq.completion_tokens > 1 and decode_time > 0 else 0.0
        return gateway_pb2.Completion(
            finish_reason=_FINISH_TO_PB[seq.finish_reason or FinishReason.ERROR],
            usage=gateway_pb2.Usage(prompt_tokens=len(seq.prompt), completion_tokens=seq.completion_tokens),
            speculation=gateway_pb2.SpeculationStats(
                acceptance_rate=seq.counts.acceptance_rate,
                mean_acceptance_length=seq.counts.mean_acceptance_length,
                num_rounds=seq.counts.rounds,
                num_draft_tokens=seq.counts.draft_tokens,
                num_accepted_tokens=seq.counts.accepted_tokens,
            ),
            timings=gateway_pb2.Timings(time_to_first_token_s=ttft, total_s=total, tokens_per_s=rate),
            error_message=error,
            anatomy=gateway_pb2.RoundAnatomy(**{f"{name}_s": value for name, value in seq.anatomy.seconds.items()}),
        )


async def create_gateway(config: GatewayConfig) -> RunningServer:
    """Connect to the model services, check them, start the scheduler and the server."""
    target = TargetClient(config.target_address, config.max_message_bytes)
    probs_dtype = common_pb2.DTYPE_BFLOAT16 if config.draft_probs_dtype == "bfloat16" else common_pb2.DTYPE_FLOAT32
    draft = DraftClient(config.draft_address, config.max_message_bytes, probs_dtype) if config.draft_address else None
    target_info = await target.info()
    draft_info = await draft.info() if draft is not None else None
    tokenizer = load_tokenizer(target_info.model_name)
    if tokenizer_fingerprint(tokenizer) != target_info.tokenizer_fingerprint:
        raise SpecdecError(f"the gateway's tokenizer for {target_info.model_name!r} differs from the target's")
    limits = [target_info]
    if draft_info is not None:
        check_compatible(_tokenizer_info(draft_info), _tokenizer_info(target_info))
        limits.append(draft_info)
    max_speculative_tokens = min(info.max_speculative_tokens for info in limits)
    if draft is not None and config.num_speculative_tokens > max_speculative_tokens:
        raise InvalidArgumentError(f"num_speculative_tokens {config.num_speculative_tokens} exceeds the services' maximum {max_speculative_tokens}")
    max_seq_len = min(info.max_seq_len for info in limits)
    metrics = GatewayMetrics()
    planner = KPlanner(
        forward_costs_from_pb(target_info),
        forward_costs_from_pb(draft_info) if draft_info is not None and config.adaptive_k else [],
    )
    pools = [
        PoolLimits(name, info.total_kv_tokens, info.block_size, info.max_slots)
        for name, info in zip(("target", "draft"), limits)
    ]
    scheduler = Scheduler(
        target, draft, pools, max_seq_len=max_seq_len, max_batch_size=config.max_batch_size,
        max_queue=config.max_queue, planner=planner, metrics=metrics,
    )
    state = GatewayState(config, target, draft, target_info, draft_info, tokenizer, scheduler, metrics, max_seq_len, max_speculative_tokens)
    servicer = GatewayServicer(state)
    scheduler.start()

    async def close() -> None:
        await scheduler.stop()
        await target.close()
        if draft is not None:
            await draft.close()
        metrics.close()

    running = await start_server(
        lambda server: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server),
        [SERVICE_NAME], host=config.host, port=config.port, max_message_bytes=config.max_message_bytes,
        on_stop=close,
    )
    if config.metrics_port >= 0:
        running.metrics_port = metrics.serve(config.metrics_port, config.host)
    return running
