"""The gateway's exporter renders plain stats under any prefix, every label value from the start."""

from __future__ import annotations

from prometheus_client import generate_latest

from specdec.gateway.draft_sources import DraftSource
from specdec.gateway.metrics import gateway_endpoint
from specdec.gateway.stats import GatewayStats


def render(stats: GatewayStats, prefix: str) -> str:
    return generate_latest(gateway_endpoint(stats, "toy-model", prefix).registry).decode()


def test_vllm_prefix_gives_vllm_names_with_model_name() -> None:
    stats = GatewayStats(max_speculative_tokens=3)
    stats.record_round(k=3, num_accepted=2)
    stats.record_round(k=2, num_accepted=2, source=DraftSource.PROMPT_LOOKUP)
    text = render(stats, "vllm:")
    assert 'vllm:spec_decode_num_drafts_total{model_name="toy-model",source="model"} 1.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="toy-model",source="prompt_lookup"} 2.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="toy-model",source="suffix"} 0.0' in text
    per_pos = 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="toy-model",position="%d",source="%s"}'
    assert f"{per_pos % (1, 'model')} 1.0" in text and f"{per_pos % (1, 'prompt_lookup')} 1.0" in text
    assert f"{per_pos % (2, 'model')} 0.0" in text and f"{per_pos % (2, 'suffix')} 0.0" in text
    assert "specdec_" not in text


def test_every_label_value_is_exported_before_its_first_event() -> None:
    text = render(GatewayStats(max_speculative_tokens=2), "specdec_")
    for reason in ("stop", "length", "cancelled", "error"):
        assert f'specdec_request_success_total{{finished_reason="{reason}",model_name="toy-model"}} 0.0' in text
    for reason in ("not_paying", "batch", "draft_unavailable"):
        assert f'specdec_spec_decode_off_rounds_total{{model_name="toy-model",reason="{reason}"}} 0.0' in text
    assert 'specdec_e2e_request_latency_seconds_bucket{le="1200.0",model_name="toy-model"} 0.0' in text
    assert "process_cpu_seconds_total" in text


def test_inter_token_latency_is_one_observation_per_token() -> None:
    stats = GatewayStats(max_speculative_tokens=4)
    stats.record_tokens(1, None)  # the first token has no gap
    stats.record_tokens(4, 0.2)  # a round of four tokens: 50 ms each
    assert stats.generation_tokens == 5
    assert stats.inter_token_latency.count == 4 and abs(stats.inter_token_latency.total - 0.2) < 1e-12
    assert dict(stats.inter_token_latency.buckets())["0.05"] == 4
