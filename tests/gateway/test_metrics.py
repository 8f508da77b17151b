"""The Prometheus endpoint: vLLM-style speculative-decoding counters agree with the requests."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

STORY = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_speculation_counters_match_the_requests(start_stack, int8_runtime) -> None:  # type: ignore[no-untyped-def]
    stack = start_stack(int8_runtime, metrics_port=0)
    with stack.client() as client:
        results = [client.generate(STORY, max_new_tokens=n, num_speculative_tokens=4) for n in (20, 33)]
        plain = client.generate(STORY, max_new_tokens=5, speculative=False)
    stack.wait_until_idle()
    # Reservations return once both Release calls answered: the free-KV gauges settle just after.
    free = [("specdec_kv_free_tokens", (("service", service),)) for service in ("target", "draft")]
    deadline = time.monotonic() + 10
    while any((m := _scrape(stack.gateway.metrics_port))[key] != 8192 for key in free) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(m[key] == 8192 for key in free)  # every reservation returned

    assert m[("specdec_num_drafts_total", ())] == sum(r.num_rounds for r in results)
    assert m[("specdec_num_draft_tokens_total", ())] == sum(r.num_draft_tokens for r in results)
    accepted = m[("specdec_num_accepted_tokens_total", ())]
    assert accepted == sum(r.num_accepted_tokens for r in results) > 0
    per_position = [m.get(("specdec_num_accepted_tokens_per_pos_total", (("position", str(i)),)), 0.0) for i in range(4)]
    assert sum(per_position) == accepted
    assert per_position == sorted(per_position, reverse=True)  # position i+1 is accepted only after position i
    total_tokens = sum(r.completion_tokens for r in [*results, plain])
    assert m[("specdec_generation_tokens_total", ())] == total_tokens
    assert m[("specdec_request_success_total", (("finish_reason", "length"),))] == 3
    assert m[("specdec_num_requests_running", ())] == 0
    assert m[("specdec_time_to_first_token_seconds_count", ())] == 3
    assert m[("specdec_rpc_latency_seconds_count", (("method", "Verify"),))] > 0
    assert m[("specdec_rpc_latency_seconds_count", (("method", "Propose"),))] > 0
    rate = accepted / m[("specdec_num_draft_tokens_total", ())]
    assert 0.3 < rate <= 1.0  # the int8 self-draft mostly agrees
