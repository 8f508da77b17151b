"""The Prometheus endpoints of a real stack: vLLM-style counters agree with the requests,
and the model services export their own rpc, batch and KV figures."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec.model.runtime import ModelRuntime
from specdec.v1 import common_pb2, target_pb2_grpc
from tests.support.services import eventually
from tests.support.stacks import StartStack

STORY = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(port: int, drop: tuple[str, ...] = ("model_name",)) -> Samples:
    """Samples by (name, labels), without the labels every series carries."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k not in drop))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name` over the series whose labels include `labels` (e.g. over every source)."""
    return sum(value for (n, pairs), value in samples.items()
               if n == name and set(labels.items()) <= set(pairs))


def test_speculation_counters_match_the_requests(start_stack: StartStack, int8_runtime: ModelRuntime) -> None:
    stack = start_stack(int8_runtime, metrics_port=0)
    before = _scrape(stack.gateway.metrics_port)
    # Every labelled series exists before anything happened, at zero.
    assert before[("specdec_request_success_total", (("finished_reason", "error"),))] == 0
    assert before[("specdec_spec_decode_num_accepted_tokens_per_pos_total",
                   (("position", "7"), ("source", "suffix")))] == 0
    assert before[("specdec_spec_decode_off_rounds_total", (("reason", "draft_unavailable"),))] == 0
    with stack.client() as client:
        # auto: the model draft and lookups, each counted under its own source.
        results = [client.generate(STORY, max_new_tokens=n, num_speculative_tokens=4, method="auto")
                   for n in (20, 33)]
        plain = client.generate(STORY, max_new_tokens=5, speculative=False)
    stack.wait_until_idle()
    m = _scrape(stack.gateway.metrics_port)

    assert _total(m, "specdec_spec_decode_num_drafts_total") == sum(r.num_rounds for r in results)
    assert _total(m, "specdec_spec_decode_num_draft_tokens_total") == sum(r.num_draft_tokens for r in results)
    accepted = _total(m, "specdec_spec_decode_num_accepted_tokens_total")
    assert accepted == sum(r.num_accepted_tokens for r in results) > 0
    lookups = [_total(m, "specdec_spec_decode_num_draft_tokens_total", source=s) for s in ("prompt_lookup", "suffix")]
    assert sum(lookups) == sum(r.num_lookup_draft_tokens for r in results)
    lookup_kept = [_total(m, "specdec_spec_decode_num_accepted_tokens_total", source=s)
                   for s in ("prompt_lookup", "suffix")]
    assert sum(lookup_kept) == sum(r.num_lookup_accepted_tokens for r in results)
    per_position = [_total(m, "specdec_spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
                    for i in range(4)]
    assert sum(per_position) == accepted
    assert per_position == sorted(per_position, reverse=True)  # position i+1 is accepted only after position i
    total_tokens = sum(r.completion_tokens for r in [*results, plain])
    assert m[("specdec_generation_tokens_total", ())] == total_tokens
    # One inter-token observation per token after each request's first.
    assert m[("specdec_inter_token_latency_seconds_count", ())] == total_tokens - 3
    assert m[("specdec_request_success_total", (("finished_reason", "length"),))] == 3
    assert m[("specdec_num_requests_running", ())] == 0
    for family in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                   "request_prefill_time_seconds", "request_decode_time_seconds", "request_generation_tokens"):
        assert m[(f"specdec_{family}_count", ())] == 3, family
    assert m[("specdec_request_generation_tokens_sum", ())] == total_tokens
    assert m[("specdec_rpc_latency_seconds_count", (("method", "Verify"),))] > 0
    assert m[("specdec_rpc_latency_seconds_count", (("method", "Propose"),))] > 0
    assert m[("specdec_e2e_request_latency_seconds_bucket", (("le", "1200.0"),))] == 3  # buckets reach minutes
    assert ("process_resident_memory_bytes", ()) in m
    # The final message's acceptance rate is the same quantity as the PromQL one.
    for r in results:
        assert r.acceptance_rate == r.num_accepted_tokens / r.num_draft_tokens
    # KV usage comes from the services' own Info: back to zero once every slot is released.
    usage = ("specdec_kv_cache_usage_perc", ())
    emptied = eventually(lambda: _scrape(stack.gateway.metrics_port)[usage] == 0)
    assert emptied, "the gateway never saw the target's KV pool empty again"


def test_http_port_serves_what_an_endpoint_picker_reads(start_stack: StartStack, int8_runtime: ModelRuntime) -> None:
    """The inference-gateway contract under `--metrics-prefix vllm:`, on the port requests go to:
    queue and running gauges, the target's KV usage as one series, and its pool's shape."""
    stack = start_stack(int8_runtime, metrics_port=0, http_port=0, metrics_prefix="vllm:")
    with stack.client() as client:
        client.generate(STORY, max_new_tokens=4)
    stack.wait_until_idle()
    http, own = _scrape(stack.gateway.http_port, drop=()), _scrape(stack.gateway.metrics_port, drop=())
    assert {name for name, _ in http} == {name for name, _ in own}  # one registry, two ports
    model = (("model_name", stack.target.runtime.loaded.name),)  # the name says the suite cut it
    assert http[("vllm:num_requests_waiting", model)] == 0
    assert http[("vllm:num_requests_running", model)] == 0
    assert [labels for name, labels in http if name == "vllm:kv_cache_usage_perc"] == [model]
    assert ("vllm:spec_decode_draft_kv_cache_usage_perc", model) in http
    cache = stack.target.cache
    (config, value), = [(dict(labels), v) for (name, labels), v in http.items() if name == "vllm:cache_config_info"]
    assert value == 1
    assert int(config["block_size"]) == cache.block_size
    assert int(config["num_gpu_blocks"]) == cache.blocks.num_blocks


def test_model_services_export_rpc_batch_and_kv_metrics(start_stack: StartStack, int8_runtime: ModelRuntime) -> None:
    stack = start_stack(int8_runtime, target={"metrics_port": 0}, draft={"metrics_port": 0})
    target_port, draft_port = (server.metrics_port for server in stack.servers)
    assert target_port and draft_port
    with stack.client() as client:
        client.generate(STORY, max_new_tokens=12, num_speculative_tokens=3)
    stack.wait_until_idle()
    target, draft = _scrape(target_port), _scrape(draft_port)

    def t(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        return name, tuple(sorted({"service": "target", **labels}.items()))

    assert target[t("specdec_service_rpc_latency_seconds_count", method="Prefill")] == 1
    assert target[t("specdec_service_model_info", quantization="none", dtype="float32", device="cpu",
                    decode_layers="eager")] == 1
    draft_info = ("specdec_service_model_info", (("decode_layers", "eager"), ("device", "cpu"), ("dtype", "bfloat16"),
                                                 ("quantization", "int8"), ("service", "draft")))
    assert draft[draft_info] == 1  # the test stacks run with --compile off
    # 11 tokens after the first, at most 4 a round: at least 3 verifies of 1 + K tokens.
    assert target[t("specdec_service_compute_seconds_count", method="Verify")] >= 3
    assert target[t("specdec_service_forward_tokens_sum", method="Verify")] >= 3 * 2
    assert draft[("specdec_service_forward_batch_size_count", (("method", "Propose"), ("service", "draft")))] >= 1
    total = target[t("specdec_service_kv_blocks_total")]
    assert target[t("specdec_service_kv_blocks", state="free")] == total > 0
    assert target[t("specdec_service_kv_blocks", state="used")] == 0
    assert target[t("specdec_service_active_slots")] == 0
    assert target[t("specdec_service_rpc_errors_total", method="Release", code="NOT_FOUND")] == 0
    # A bad call is counted under its status code.
    with grpc.insecure_channel(f"127.0.0.1:{stack.servers[0].port}") as channel:
        with pytest.raises(grpc.RpcError) as refused:
            target_pb2_grpc.TargetServiceStub(channel).Release(common_pb2.ReleaseRequest(slot_id="nobody"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert _scrape(target_port)[t("specdec_service_rpc_errors_total", method="Release", code="NOT_FOUND")] == 1
