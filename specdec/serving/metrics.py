"""What a model service counts, and its Prometheus exporter (see docs/metrics.md).

`ServiceStats` is plain numbers recorded by the servicer; KV blocks and slots are read
from the engine at scrape time (counters only, each read atomic under the GIL). With the
default prefix:

    RPC p95 by method   = histogram_quantile(0.95,
                              sum by (le, method) (rate(specdec_service_rpc_latency_seconds_bucket[5m])))
    compute share       = rate(specdec_service_compute_seconds_sum[5m])
                          / ignoring(le) rate(specdec_service_rpc_latency_seconds_sum[5m])
    KV usage            = specdec_service_kv_blocks{state="used"} / ignoring(state) specdec_service_kv_blocks_total
    prefix-cache hits   = rate(specdec_service_prefix_cache_hits_total[5m])
                          / rate(specdec_service_prefix_cache_queries_total[5m])
    errors by code      = sum by (method, code) (rate(specdec_service_rpc_errors_total[5m]))
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client.core import Metric

from specdec.serving.engine import ModelEngine
from specdec.stats import BATCH_BUCKETS, LATENCY_BUCKETS, TOKEN_BUCKETS, Distribution, Families, MetricsEndpoint

#: Status codes the services answer with on purpose (see specdec.errors), plus the generic ones.
ERROR_CODES = (
    "INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "INTERNAL",
    "UNAVAILABLE", "CANCELLED", "DEADLINE_EXCEEDED",
)


@dataclass
class ServiceStats:
    """Per-rpc latency and errors, and per-forward compute, batch size and tokens."""

    service: str  # "target" or "draft"
    methods: Sequence[str]
    work_methods: Sequence[str]  # those that run the model: Prefill / Verify, or Propose
    rpc_latency: dict[str, Distribution] = field(default_factory=dict)
    errors: dict[tuple[str, ...], int] = field(default_factory=dict)  # (method, code) -> count
    compute: dict[str, Distribution] = field(default_factory=dict)
    batch_size: dict[str, Distribution] = field(default_factory=dict)
    tokens: dict[str, Distribution] = field(default_factory=dict)
    #: Calls that ran in one forward with another gateway's (`specdec.serving.call_merger`).
    merged_calls: dict[str, int] = field(default_factory=dict)
    #: Holds of a run for due gateways' calls: seconds held, and the gateways that came / were missed.
    merge_wait: dict[str, Distribution] = field(default_factory=dict)
    merge_waits: dict[tuple[str, ...], int] = field(default_factory=dict)  # (method, outcome) -> count

    def __post_init__(self) -> None:
        for method in self.methods:
            self.rpc_latency[method] = Distribution(LATENCY_BUCKETS)
            for code in ERROR_CODES:
                self.errors[(method, code)] = 0
        for method in self.work_methods:
            self.compute[method] = Distribution(LATENCY_BUCKETS)
            self.batch_size[method] = Distribution(BATCH_BUCKETS)
            self.tokens[method] = Distribution(TOKEN_BUCKETS)
            self.merged_calls[method] = 0
            self.merge_wait[method] = Distribution(LATENCY_BUCKETS)
            for outcome in ("joined", "missed"):
                self.merge_waits[(method, outcome)] = 0

    def record_rpc(self, method: str, seconds: float, code: str) -> None:
        """An rpc finished with status `code` ("OK" or a grpc.StatusCode name)."""
        if method in self.rpc_latency:
            self.rpc_latency[method].observe(seconds)
        if code != "OK":
            self.errors[(method, code)] = self.errors.get((method, code), 0) + 1

    def record_work(self, method: str, compute_s: float, batch_size: int, tokens: int) -> None:
        self.compute[method].observe(compute_s)
        self.batch_size[method].observe(batch_size)
        self.tokens[method].observe(tokens)

    def record_merged(self, method: str, calls: int) -> None:
        self.merged_calls[method] += calls

    def record_merge_wait(self, method: str, seconds: float, joined: int, missed: int) -> None:
        self.merge_wait[method].observe(seconds)
        self.merge_waits[(method, "joined")] += joined
        self.merge_waits[(method, "missed")] += missed


def service_families(stats: ServiceStats, engine: ModelEngine, prefix: str) -> Iterator[Metric]:
    f = Families(prefix, {"model_name": engine.runtime.loaded.name, "service": stats.service})
    forward = engine.model
    yield f.gauge("service_model_info", "How the model runs (always 1): weights, compute dtype, device, and whether a "
                  "single request's decode step runs compiled decoder layers",
                  ["quantization", "dtype", "device", "decode_layers"],
                  {(engine.runtime.quantization, str(forward.dtype).removeprefix("torch."), engine.cache.device.type,
                    "compiled" if engine.tuner.compiled_steps(forward) else "eager"): 1})
    yield f.histogram("service_rpc_latency_seconds", "Server-side rpc latency, queueing on the model worker included",
                      ["method"], {(m,): d for m, d in stats.rpc_latency.items()})
    yield f.counter("service_rpc_errors", "Rpcs that ended with a non-OK status", ["method", "code"], stats.errors)
    yield f.histogram("service_compute_seconds", "Compute time on the model worker", ["method"],
                      {(m,): d for m, d in stats.compute.items()})
    yield f.histogram("service_forward_batch_size", "Requests per run (calls merged across gateways run as one)",
                      ["method"], {(m,): d for m, d in stats.batch_size.items()})
    yield f.histogram("service_forward_tokens", "New tokens per run, over its requests", ["method"],
                      {(m,): d for m, d in stats.tokens.items()})
    yield f.counter("service_merged_calls", "Calls that ran in one forward with another gateway's calls", ["method"],
                    {(m,): n for m, n in stats.merged_calls.items()})
    yield f.histogram("service_merge_wait_seconds", "How long a run was held for other gateways' calls that were due",
                      ["method"], {(m,): d for m, d in stats.merge_wait.items()})
    yield f.counter("service_merge_waits", "Gateways a held run waited for, by whether their call came in time",
                    ["method", "outcome"], stats.merge_waits)
    blocks = engine.cache.blocks
    yield f.gauge("service_kv_blocks", "KV-cache blocks", ["state"],
                  {("free",): blocks.num_free_blocks, ("used",): blocks.num_blocks - blocks.num_free_blocks})
    yield f.gauge("service_kv_blocks_total", "KV-cache capacity in blocks", [], {(): blocks.num_blocks})
    yield f.gauge("service_kv_reserved_blocks", "Free KV-cache blocks that slots have reserved to grow into "
                  "(while gateways share the pool, new slots are not given them)", [],
                  {(): sum(engine.reservations.growth(blocks).values())})
    yield f.gauge("service_active_slots", "Slots (requests) held", [], {(): len(engine.tokens)})
    yield f.counter("service_prefix_cache_queries", "Prompt tokens of new slots, looked up in the prefix cache", [],
                    {(): engine.prefix_cache_queries})
    yield f.counter("service_prefix_cache_hits", "Prompt tokens of new slots found in the prefix cache (not computed)",
                    [], {(): engine.prefix_cache_hits})
    leases = engine.leases
    yield f.gauge("service_lease_holders", "Gateways whose lease is current", [], {(): leases.num_holders})
    yield f.counter("service_lease_freed_slots", "Slots freed without a Release: the holder's lease expired, "
                    "or it restarted (swept)", ["reason"],
                    {("expired",): leases.expired_slots_total, ("swept",): leases.swept_slots_total})


def service_endpoint(stats: ServiceStats, engine: ModelEngine, prefix: str) -> MetricsEndpoint:
    return MetricsEndpoint(lambda: service_families(stats, engine, prefix))
