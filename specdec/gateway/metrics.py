"""The gateway's Prometheus exporter: renders `GatewayStats` at scrape time.

Names follow vLLM's with the prefix `specdec_` for `vllm:` (`--metrics-prefix vllm:` makes
them identical), and every series carries `model_name`. The speculation counters carry the
draft `source` too (model, prompt_lookup, suffix, lookup_then_model): sum it away for vLLM's totals, or keep it
(`sum by (source)`) for each source's figures. With the default prefix:

    acceptance rate          = sum(rate(specdec_spec_decode_num_accepted_tokens_total[5m]))
                               / sum(rate(specdec_spec_decode_num_draft_tokens_total[5m]))
    mean acceptance length   = 1 + sum(rate(specdec_spec_decode_num_accepted_tokens_total[5m]))
                                   / sum(rate(specdec_spec_decode_num_drafts_total[5m]))
    per-position acceptance  = sum by (position) (rate(specdec_spec_decode_num_accepted_tokens_per_pos_total[5m]))
                               / ignoring(position) group_left sum(rate(specdec_spec_decode_num_drafts_total[5m]))
    acceptance by source     = sum by (source) (rate(specdec_spec_decode_num_accepted_tokens_total[5m]))
                               / sum by (source) (rate(specdec_spec_decode_num_draft_tokens_total[5m]))
    tokens/s                 = rate(specdec_generation_tokens_total[1m])
    TTFT p95                 = histogram_quantile(0.95,
                                   sum by (le) (rate(specdec_time_to_first_token_seconds_bucket[5m])))
    round time by phase      = rate(specdec_round_time_seconds_total[5m])
    speculation turned off   = sum by (reason) (rate(specdec_spec_decode_off_rounds_total[5m]))

The planner's state (`gateway.planner.status`): is speculation off, since when, why.

    off, for how long        = specdec_spec_decode_off_seconds > 0
                               (seconds of decoding since any source last drafted on its merits;
                               idle time does not count, so it grows only while requests decode)
    which sources are off    = specdec_spec_decode_source_state{state="off"} == 1
    each source, since       = specdec_spec_decode_source_off_seconds
    why (recent switches)    = sum by (source, reason) (increase(specdec_spec_decode_source_switches_total[1h])) > 0
    when it switched         = the steps of specdec_spec_decode_source_switches_total
    the estimates behind it  = specdec_spec_decode_planner_acceptance (by source),
                               specdec_spec_decode_planner_draft_cost_ratio, ..._expected_speedup

A source the planner reports nothing for (the model draft on a gateway without one; every
source before the first round) has every `state` at 0, `off_seconds` 0 and acceptance NaN.
An estimate the planner does not have is NaN, as a summary's quantiles are before their first
observation: its series exists from the start, comparisons with it are false (no alert fires
on it) and Grafana draws a gap.

docs/metrics.md lists every family.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from prometheus_client.core import Metric

from specdec.gateway.draft_sources import DraftSource
from specdec.gateway.planner.status import (
    PLANNED_SOURCES,
    SOURCE_STATES,
    SWITCH_REASONS,
    PlannerStatus,
    SourceStatus,
)
from specdec.gateway.stats import GatewayStats
from specdec.stats import DEFAULT_PREFIX, Families, MetricsEndpoint


def _one(value: float) -> dict[tuple[str, ...], float]:
    return {(): value}


def _by_source(counts: dict[DraftSource, int]) -> dict[tuple[str, ...], float]:
    return {(source.value,): n for source, n in counts.items()}


def gateway_families(stats: GatewayStats, prefix: str, model_name: str) -> Iterator[Metric]:
    f = Families(prefix, {"model_name": model_name})
    s = stats
    yield f.gauge("num_requests_running", "Requests decoding", [], _one(s.running))
    yield f.gauge("num_requests_waiting", "Requests queued for admission", [], _one(s.waiting))
    # The target's pool alone, unlabelled: the one series per pod an endpoint picker reads.
    yield f.gauge("kv_cache_usage_perc", "Fraction of the target's KV blocks in use (0..1), from its Info", [],
                  _one(s.kv_usage["target"]))
    yield f.gauge("spec_decode_draft_kv_cache_usage_perc", "Fraction of the draft's KV blocks in use (0..1), "
                  "from its Info", [], _one(s.kv_usage["draft"]))
    labels = sorted(s.target_cache)
    yield f.gauge("cache_config_info", "The target's KV pool (value 1; the labels say it, as vLLM's)", labels,
                  {tuple(s.target_cache[k] for k in labels): 1.0} if labels else {})
    yield f.counter("prompt_tokens", "Prompt tokens admitted", [], _one(s.prompt_tokens))
    yield f.counter("generation_tokens", "Completion tokens streamed", [], _one(s.generation_tokens))
    yield f.counter("request_success", "Finished requests by reason", ["finished_reason"],
                    {(reason,): n for reason, n in s.finished.items()})
    yield f.histogram("request_prompt_tokens", "Prompt tokens per request", [], {(): s.request_prompt_tokens})
    yield f.histogram("request_generation_tokens", "Completion tokens per request", [],
                      {(): s.request_generation_tokens})
    for name, doc, dist in (
        ("time_to_first_token_seconds", "Arrival to first token", s.time_to_first_token),
        ("inter_token_latency_seconds", "Time between streamed tokens (a round's tokens share its time)",
         s.inter_token_latency),
        ("time_per_output_token_seconds", "Per request: decode time / (completion tokens - 1)",
         s.time_per_output_token),
        ("e2e_request_latency_seconds", "Arrival to the final message", s.e2e_latency),
        ("request_queue_time_seconds", "Arrival to admission", s.queue_time),
        ("request_prefill_time_seconds", "Admission to first token", s.prefill_time),
        ("request_decode_time_seconds", "First token to the final message", s.decode_time),
        ("request_inference_time_seconds", "Admission to the final message", s.inference_time),
    ):
        yield f.histogram(name, doc, [], {(): dist})
    yield f.counter("spec_decode_num_drafts", "Speculation rounds with K >= 1, per request, by draft source",
                    ["source"], _by_source(s.drafts))
    yield f.counter("spec_decode_num_draft_tokens", "Draft tokens proposed, by draft source", ["source"],
                    _by_source(s.draft_tokens))
    yield f.counter("spec_decode_num_accepted_tokens", "Draft tokens accepted, by draft source", ["source"],
                    _by_source(s.accepted_tokens))
    yield f.counter("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft and "
                    "draft source", ["position", "source"],
                    {(str(i), source.value): n for source, counts in s.accepted_per_position.items()
                     for i, n in enumerate(counts)})
    yield f.counter("spec_decode_num_forced_tokens", "Draft tokens a structured-output request's grammar forced "
                    "(drafted with no draft step, kept for certain: the grammar's own drafts and the draft model's "
                    "forced guesses)", [], _one(s.forced_tokens))
    yield f.counter("spec_decode_num_emitted_tokens", "Tokens emitted by rounds (accepted + recovered or bonus; "
                    "every token of a multi-step plain round)", [], _one(s.emitted_tokens))
    yield f.gauge("speculation_enabled", "1 while the draft is usable; 0 from a failed or late Propose until its "
                  "health check passes", [], _one(s.speculation_enabled))
    yield f.gauge("spec_decode_num_speculative_tokens", "Mean K of the last round's speculating requests", [],
                  _one(s.current_k))
    yield f.counter("spec_decode_off_rounds", "Rounds in which a request that could speculate drafted nothing, "
                    "by reason", ["reason"], {(reason,): n for reason, n in s.off_rounds.items()})
    yield f.counter("num_preemptions", "Requests preempted to make room in a KV pool (they resume later)", [],
                    _one(s.preemptions))
    yield f.histogram("request_resume_seconds", "Requests that lost their target and resumed from their tokens on "
                      "the one that answered: seconds from the loss to their first good round", [],
                      {(): s.resume_time})
    yield f.counter("num_pool_refusals", "Calls a model service refused for want of KV blocks or slots (pools "
                    "shared with other gateways): queued or preempted, never failed", ["service"],
                    {(name,): n for name, n in s.pool_refusals.items()})
    yield f.gauge("admission_limit", "Requests the gateway runs at once: its max batch size, lower for a while "
                  "after a shared pool refused it room", [], _one(s.admission_limit))
    yield f.counter("spec_decode_draft_failures", "Rounds whose Propose failed and ran as plain decoding", [],
                    _one(s.draft_failures))
    yield f.counter("spec_decode_kv_handoff_tokens", "Tokens whose keys and values the target's cache copied into "
                    "the draft's, which the draft did not compute", [], _one(s.kv_handoff_tokens))
    yield f.gauge("spec_decode_draft_overhead_ratio", "Propose time / Verify time in the last round", [],
                  _one(s.draft_overhead))
    yield f.counter("round_time_seconds", "Round wall time by phase", ["phase"],
                    {(phase,): v for phase, v in s.round_seconds.items()})
    yield f.histogram("rpc_latency_seconds", "Model-service calls as the gateway sees them", ["method"],
                      {(m,): d for m, d in s.rpc_latency.items()})
    yield f.histogram("round_batch_size", "Requests per speculation round", [], {(): s.batch_size})
    yield from planner_families(f, s.planner)


def planner_families(f: Families, status: PlannerStatus) -> Iterator[Metric]:
    """The planner's state after the last round: every planned source, state and reason from the start."""
    yield f.gauge("spec_decode_source_state", "1 for the draft source's current state with the planner, 0 for the "
                  "others (all 0: the planner reports none for it)", ["source", "state"], _source_states(status))
    yield f.gauge("spec_decode_source_off_seconds", "Seconds of decoding since the source last drafted on its merits "
                  "(0 while it does; probes do not reset it)", ["source"], _per_source(status, lambda s: s.off_s, 0.0))
    yield f.gauge("spec_decode_off_seconds", "Seconds of decoding since any source last drafted on its merits", [],
                  _one(status.off_s))
    yield f.counter("spec_decode_source_switches", "Planner switches of a draft source, by reason (pays: back on)",
                    ["source", "reason"], {(source.value, reason.value): status.switches.get((source, reason), 0)
                                           for source in PLANNED_SOURCES for reason in SWITCH_REASONS})
    yield f.gauge("spec_decode_planner_acceptance", "The planner's acceptance estimate per draft source (NaN: none)",
                  ["source"], _per_source(status, lambda s: s.acceptance, math.nan))
    yield f.gauge("spec_decode_planner_draft_cost_ratio", "Draft 1-token step / target step at batch 1, as the "
                  "planner prices them (NaN: no draft model or no costs)", [], _one(status.draft_cost_ratio))
    yield f.gauge("spec_decode_planner_forward_rows", "Rows of the service's forwards per row of this gateway's "
                  "calls, as the planner prices rounds (1: its own; more while the service merges other gateways' "
                  "calls into them)", ["service"], {(service,): rows for service, rows in status.forward_rows.items()})
    yield f.gauge("spec_decode_planner_expected_speedup", "The last planned round's expected tokens/s / a plain "
                  "round's", [], _one(status.expected_speedup))


def _per_source(status: PlannerStatus, value: Callable[[SourceStatus], float],
                missing: float) -> dict[tuple[str, ...], float]:
    """`value` of each planned source's status; `missing` where the planner reports none."""
    return {(source.value,): value(s) if (s := status.of(source)) else missing for source in PLANNED_SOURCES}


def _source_states(status: PlannerStatus) -> dict[tuple[str, ...], float]:
    states = {source: s.state if (s := status.of(source)) else None for source in PLANNED_SOURCES}
    return {(source.value, state.value): float(states[source] is state)
            for source in PLANNED_SOURCES for state in SOURCE_STATES}


def gateway_endpoint(stats: GatewayStats, model_name: str, prefix: str = DEFAULT_PREFIX) -> MetricsEndpoint:
    return MetricsEndpoint(lambda: gateway_families(stats, prefix, model_name))
