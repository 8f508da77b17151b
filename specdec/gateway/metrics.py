"""Gateway statistics and their Prometheus exporter.

Metric names mirror vLLM's speculative-decoding metrics (with the `specdec_` prefix) so
existing dashboards carry over:

    acceptance rate          = rate(specdec_num_accepted_tokens_total[1m]) / rate(specdec_num_draft_tokens_total[1m])
    mean acceptance length   = 1 + rate(specdec_num_accepted_tokens_total[1m]) / rate(specdec_num_drafts_total[1m])
    per-position acceptance  = rate(specdec_num_accepted_tokens_per_pos_total[1m]) / ignoring(position) group_left rate(specdec_num_drafts_total[1m])
    round time by phase      = rate(specdec_round_time_seconds_total[1m]) / ignoring(phase) group_left sum(rate(specdec_round_time_seconds_total[1m]))
    speculation turned off   = rate(specdec_speculation_off_rounds_total[5m]) by (reason)

Each gateway owns its registry (no process-global state), so several gateways can live in
one process (tests) without clashing.
"""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from specdec.gateway.k_planner import OFF_REASONS
from specdec.gateway.sequence import ROUND_PHASES
from specdec.gateway.speculative_step import RoundReport

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self._http: WSGIServer | None = None
        self.registry = CollectorRegistry()
        r = self.registry
        self.num_drafts = Counter("specdec_num_drafts", "Speculation rounds with K >= 1, per request", registry=r)
        self.num_draft_tokens = Counter("specdec_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.num_accepted_tokens = Counter("specdec_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.num_accepted_per_pos = Counter(
            "specdec_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft",
            ["position"], registry=r,
        )
        self.num_emitted_tokens = Counter("specdec_num_emitted_tokens", "Tokens emitted by rounds (accepted + recovered/bonus)", registry=r)
        self.draft_failures = Counter(
            "specdec_draft_failures", "Rounds whose Propose failed and that ran without speculation", registry=r
        )
        self.current_k = Gauge("specdec_num_speculative_tokens", "Mean K of the last round's speculating requests", registry=r)
        self.draft_overhead = Gauge(
            "specdec_draft_overhead_ratio", "Propose time / Verify time in the last round", registry=r
        )
        self.speculation_off = Counter(
            "specdec_speculation_off_rounds",
            "Rounds in which the planner drafted nothing for some request that could speculate, by reason",
            ["reason"], registry=r,
        )
        self.round_time = Counter(
            "specdec_round_time_seconds", "Round wall time by phase (see gateway.sequence.ROUND_PHASES)",
            ["phase"], registry=r,
        )
        for reason in OFF_REASONS:
            self.speculation_off.labels(reason=reason)
        for phase in ROUND_PHASES:
            self.round_time.labels(phase=phase)
        self.active_requests = Gauge("specdec_num_requests_running", "Requests decoding", registry=r)
        self.waiting_requests = Gauge("specdec_num_requests_waiting", "Requests queued for admission", registry=r)
        self.free_kv_tokens = Gauge(
            "specdec_kv_free_tokens", "KV tokens not reserved by admitted requests", ["service"], registry=r
        )
        self.rpc_latency = Histogram(
            "specdec_rpc_latency_seconds", "Gateway-side latency of model-service calls", ["method"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.request_latency = Histogram(
            "specdec_e2e_request_latency_seconds", "Request latency, admission queue included",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram(
            "specdec_time_per_output_token_seconds", "Mean inter-token latency per request",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.finished = Counter("specdec_request_success", "Finished requests by reason", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("specdec_generation_tokens", "Completion tokens streamed", registry=r)

    def record_round(self, k: int, num_accepted: int) -> None:
        self.num_emitted_tokens.inc(num_accepted + 1)
        if k == 0:
            return
        self.num_drafts.inc()
        self.num_draft_tokens.inc(k)
        self.num_accepted_tokens.inc(num_accepted)
        for position in range(num_accepted):
            self.num_accepted_per_pos.labels(position=str(position)).inc()

    def record_phases(self, phases: dict[str, float], report: RoundReport) -> None:
        """One round's timings: RPC latencies, the phase split, mean K and draft overhead."""
        self.rpc_latency.labels(method="Verify").observe(report.verify.wall_s)
        speculating = [k for k in report.ks.values() if k > 0]
        if speculating:
            self.rpc_latency.labels(method="Propose").observe(report.propose.wall_s)
        for name, seconds in phases.items():
            self.round_time.labels(phase=name).inc(seconds)
        verify_s = report.verify.wall_s
        self.draft_overhead.set(report.propose.wall_s / verify_s if speculating and verify_s > 0 else 0.0)
        self.current_k.set(sum(speculating) / len(speculating) if speculating else 0)

    def serve(self, port: int, host: str) -> int:
        """Start the /metrics HTTP endpoint; returns the bound port."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http.server_port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
