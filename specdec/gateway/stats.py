"""The gateway's statistics as plain numbers (no Prometheus here; see `gateway.metrics`).

The scheduler records rounds and finished requests; the service-info poller records the
services' KV usage. Every labelled value exists from the start (all finish reasons, all
draft positions, all off reasons and phases), so exported counters never appear late.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.gateway.draft_sources import DRAFT_SOURCES, DraftSource
from specdec.gateway.planner import OFF_REASONS, PlannerStatus
from specdec.gateway.request import ROUND_PHASES, FinishReason, Request
from specdec.gateway.rounds import RoundReport
from specdec.stats import BATCH_BUCKETS, LATENCY_BUCKETS, TOKEN_BUCKETS, Distribution

RPC_METHODS = ("Prefill", "Verify", "Propose")
SERVICES = ("target", "draft")


def _latency() -> Distribution:
    return Distribution(LATENCY_BUCKETS)


def _tokens() -> Distribution:
    return Distribution(TOKEN_BUCKETS)


@dataclass
class GatewayStats:
    """Everything the gateway counts. K positions run 0..max_speculative_tokens-1."""

    max_speculative_tokens: int
    running: int = 0
    waiting: int = 0
    #: Fraction of each service's KV blocks in use, from its Info.
    kv_usage: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SERVICES, 0.0))
    #: The target's KV pool as vLLM's `cache_config_info` labels it (from its Info; empty before).
    target_cache: dict[str, str] = field(default_factory=dict)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in FinishReason})
    request_prompt_tokens: Distribution = field(default_factory=_tokens)
    request_generation_tokens: Distribution = field(default_factory=_tokens)
    time_to_first_token: Distribution = field(default_factory=_latency)
    inter_token_latency: Distribution = field(default_factory=_latency)
    time_per_output_token: Distribution = field(default_factory=_latency)
    e2e_latency: Distribution = field(default_factory=_latency)
    queue_time: Distribution = field(default_factory=_latency)
    prefill_time: Distribution = field(default_factory=_latency)
    decode_time: Distribution = field(default_factory=_latency)
    inference_time: Distribution = field(default_factory=_latency)
    #: Speculation, per request and round (vLLM's spec_decode_* counters), by draft source.
    drafts: dict[DraftSource, int] = field(default_factory=lambda: dict.fromkeys(DRAFT_SOURCES, 0))
    draft_tokens: dict[DraftSource, int] = field(default_factory=lambda: dict.fromkeys(DRAFT_SOURCES, 0))
    accepted_tokens: dict[DraftSource, int] = field(default_factory=lambda: dict.fromkeys(DRAFT_SOURCES, 0))
    emitted_tokens: int = 0
    #: Draft tokens a grammar forced (no draft step each): grammar drafts and forced guesses.
    forced_tokens: int = 0
    accepted_per_position: dict[DraftSource, list[int]] = field(default_factory=dict)
    #: 0 while the draft is degraded (a failed or late Propose, until its health check passes).
    speculation_enabled: int = 1
    current_k: float = 0.0
    draft_overhead: float = 0.0
    off_rounds: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OFF_REASONS, 0))
    draft_failures: int = 0
    #: Tokens whose keys and values the target's cache gave the draft's (`kv_handoff`).
    kv_handoff_tokens: int = 0
    #: Requests whose slots were freed to make room in a KV pool (they resume later).
    preemptions: int = 0
    #: Seconds from a request losing its target to its first good round after (`target_outage`).
    resume_time: Distribution = field(default_factory=_latency)
    #: Calls a model service refused for want of KV blocks or slots, by service (`gateway.pools`).
    pool_refusals: dict[str, int] = field(default_factory=lambda: {"target": 0, "draft": 0})
    #: Requests the gateway runs at once: its max batch size, lower while shared pools refuse it room.
    admission_limit: int = 0
    round_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ROUND_PHASES, 0.0))
    rpc_latency: dict[str, Distribution] = field(default_factory=lambda: {m: _latency() for m in RPC_METHODS})
    batch_size: Distribution = field(default_factory=lambda: Distribution(BATCH_BUCKETS))
    #: The planner's state after the last round: each source's state and the live estimates.
    planner: PlannerStatus = field(default_factory=PlannerStatus)

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = {source: [0] * self.max_speculative_tokens for source in DRAFT_SOURCES}

    def record_round(self, k: int, num_accepted: int, steps: int = 1, source: DraftSource = DraftSource.MODEL,
                     forced: int = 0) -> None:
        """One request's part in a round: K drafted by `source` (`forced` of them forced by its
        grammar), `num_accepted` of them kept (or, plain, `steps` tokens decoded in one call)."""
        self.emitted_tokens += num_accepted + steps
        if k == 0:
            return
        self.forced_tokens += forced
        self.drafts[source] += 1
        self.draft_tokens[source] += k
        self.accepted_tokens[source] += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[source][position] += 1

    def record_phases(self, phases: dict[str, float], report: RoundReport) -> None:
        """One round's timings: RPC latencies, the phase split, mean K and draft overhead."""
        self.batch_size.observe(len(report.ks))
        self.rpc_latency["Verify"].observe(report.verify.wall_s)
        speculating = [k for k in report.ks.values() if k > 0]
        if any(not source.is_lookup for source in report.sources.values()):
            self.rpc_latency["Propose"].observe(report.propose.wall_s)
        for name, seconds in phases.items():
            self.round_seconds[name] += seconds
        verify_s = report.verify.wall_s
        self.draft_overhead = report.propose.wall_s / verify_s if speculating and verify_s > 0 else 0.0
        self.current_k = sum(speculating) / len(speculating) if speculating else 0.0

    def record_tokens(self, count: int, gap_s: float | None) -> None:
        """`count` tokens streamed together, `gap_s` after the request's previous ones (None
        for its first): each token's inter-token latency is its share of the gap."""
        self.generation_tokens += count
        if gap_s is not None and count > 0:
            for _ in range(count):
                self.inter_token_latency.observe(gap_s / count)

    def record_finished(self, seq: Request) -> None:
        """A request's final message went out: its counts and its timeline."""
        assert seq.finish_reason is not None and seq.finished_at is not None
        self.finished[seq.finish_reason.value] += 1
        self.request_prompt_tokens.observe(len(seq.prompt))
        self.request_generation_tokens.observe(seq.completion_tokens)
        self.e2e_latency.observe(seq.finished_at - seq.created_at)
        admitted = seq.admitted_at if seq.admitted_at is not None else seq.finished_at
        self.queue_time.observe(admitted - seq.created_at)
        if seq.admitted_at is not None:
            self.inference_time.observe(seq.finished_at - seq.admitted_at)
        if seq.first_token_at is not None:
            self.time_to_first_token.observe(seq.first_token_at - seq.created_at)
            if seq.admitted_at is not None:
                self.prefill_time.observe(seq.first_token_at - seq.admitted_at)
            self.decode_time.observe(seq.finished_at - seq.first_token_at)
            if seq.completion_tokens > 1:
                self.time_per_output_token.observe((seq.finished_at - seq.first_token_at) / (seq.completion_tokens - 1))
