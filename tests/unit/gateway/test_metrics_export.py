"""The gateway's exporter renders plain stats under any prefix, every label value from the start."""

from __future__ import annotations

from prometheus_client import generate_latest

from specdec.gateway.draft_sources import DraftSource
from specdec.gateway.metrics import gateway_endpoint, gateway_families
from specdec.gateway.planner.status import (
    PLANNED_SOURCES,
    SOURCE_STATES,
    SWITCH_REASONS,
    PlannerStatus,
    SourceState,
    SourceStatus,
    SwitchReason,
)
from specdec.gateway.stats import GatewayStats
from tests.support.prometheus_deploy import documented_metrics


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


def _planner_status() -> PlannerStatus:
    return PlannerStatus(
        sources=(
            SourceStatus(DraftSource.MODEL, SourceState.OFF, SwitchReason.ACCEPTANCE, off_s=42.5, acceptance=0.31,
                         next_probe_rounds=7),
            SourceStatus(DraftSource.PROMPT_LOOKUP, SourceState.DRAFTING, SwitchReason.PAYS, off_s=0.0,
                         acceptance=0.8, next_probe_rounds=0),
        ),
        draft_cost_ratio=0.25, expected_speedup=1.5, off_s=12.0,
        switches={(DraftSource.MODEL, SwitchReason.ACCEPTANCE): 2, (DraftSource.PROMPT_LOOKUP, SwitchReason.PAYS): 1},
    )


def _sample(text: str, name: str, **labels: str) -> str:
    matchers = ",".join(f'{k}="{v}"' for k, v in sorted({"model_name": "toy-model", **labels}.items()))
    (line,) = [line for line in text.splitlines() if line.startswith(f"{name}{{{matchers}}} ")]
    return line.rsplit(" ", 1)[1]


def test_planner_status_is_exported_per_source_state_and_reason() -> None:
    stats = GatewayStats(max_speculative_tokens=2)
    stats.planner = _planner_status()
    text = render(stats, "specdec_")
    states = {(source, state): _sample(text, "specdec_spec_decode_source_state", source=source, state=state)
              for source in ("model", "prompt_lookup", "suffix") for state in ("drafting", "off", "probing")}
    assert {key for key, value in states.items() if value == "1.0"} == {("model", "off"), ("prompt_lookup", "drafting")}
    assert set(states.values()) == {"0.0", "1.0"}  # suffix, unreported: every state 0
    assert _sample(text, "specdec_spec_decode_source_off_seconds", source="model") == "42.5"
    assert _sample(text, "specdec_spec_decode_source_off_seconds", source="suffix") == "0.0"
    assert _sample(text, "specdec_spec_decode_off_seconds") == "12.0"
    switches = "specdec_spec_decode_source_switches_total"
    assert _sample(text, switches, source="model", reason="acceptance") == "2.0"
    assert _sample(text, switches, source="prompt_lookup", reason="pays") == "1.0"
    assert _sample(text, switches, source="suffix", reason="draft_failure") == "0.0"
    assert _sample(text, "specdec_spec_decode_planner_acceptance", source="model") == "0.31"
    assert _sample(text, "specdec_spec_decode_planner_acceptance", source="suffix") == "NaN"
    assert _sample(text, "specdec_spec_decode_planner_draft_cost_ratio") == "0.25"
    assert _sample(text, "specdec_spec_decode_planner_expected_speedup") == "1.5"


def test_planner_series_exist_before_the_planner_reports() -> None:
    """The default status (no round yet, or no draft model): every series, states 0, estimates NaN."""
    text = render(GatewayStats(max_speculative_tokens=2), "specdec_")
    for source in PLANNED_SOURCES:
        for state in SOURCE_STATES:
            assert _sample(text, "specdec_spec_decode_source_state", source=source.value, state=state.value) == "0.0"
        for reason in SWITCH_REASONS:
            assert _sample(text, "specdec_spec_decode_source_switches_total", source=source.value,
                           reason=reason.value) == "0.0"
        assert _sample(text, "specdec_spec_decode_planner_acceptance", source=source.value) == "NaN"
    assert _sample(text, "specdec_spec_decode_off_seconds") == "0.0"
    assert _sample(text, "specdec_spec_decode_planner_draft_cost_ratio") == "NaN"
    assert _sample(text, "specdec_spec_decode_planner_expected_speedup") == "1.0"


def test_every_exported_family_is_documented() -> None:
    exported = {metric.name for metric in gateway_families(GatewayStats(max_speculative_tokens=2), "specdec_", "m")}
    documented = {m.name.removesuffix("_total") for m in documented_metrics() if m.exporter == "gateway"}
    assert exported == documented
