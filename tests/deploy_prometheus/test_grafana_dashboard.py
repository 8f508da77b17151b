"""deploy/grafana: provisioning and the specdec dashboard.

Every query of the dashboard must use documented metric names only, go through the
`model_name` variable, and return series: the last is checked with promtool against
synthetic series shaped like the services' exports (every documented family, with the
labels docs/metrics.md gives them), once as at start-up (counters at zero) and once under
load.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.dashboard_queries import (
    DASHBOARD,
    iter_panels,
    load_dashboard,
    metric_names,
    panel_queries,
    variable_defaults,
)
from tests.support.prometheus_deploy import (
    DASHBOARD_PROVIDERS,
    DATASOURCES,
    PROCESS_METRICS,
    REPO,
    SCRAPE_JOBS,
    DocumentedMetric,
    documented_metrics,
    documented_series_names,
    load_yaml,
    needs_promtool,
    run_promtool,
)

TARGET_MODEL = "smollm2-135m"
DRAFT_MODEL = "smollm2-135m-int4"  # the draft's own model_name may differ from the target's


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return load_dashboard()


def _query_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [panel for panel in iter_panels(dashboard) if panel["type"] != "row"]


def _datasource_uid() -> str:
    (source,) = load_yaml(DATASOURCES)["datasources"]
    return str(source["uid"])


# ---------------------------------------------------------------- provisioning

def test_datasource_provisioning() -> None:
    (source,) = load_yaml(DATASOURCES)["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    assert source["uid"] and source["access"] == "proxy"


def test_dashboard_provider_reads_the_dashboards_folder() -> None:
    (provider,) = load_yaml(DASHBOARD_PROVIDERS)["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


def test_docker_compose_mounts_what_provisioning_expects() -> None:
    """The provider's path and Prometheus's config folder are where docker-compose mounts them."""
    compose = load_yaml(REPO / "docker-compose.yml")
    services = compose.get("services") or {}
    if "grafana" not in services or "prometheus" not in services:
        pytest.skip("docker-compose.yml runs no grafana and prometheus services")
    grafana = set(services["grafana"].get("volumes", []))
    (provider,) = load_yaml(DASHBOARD_PROVIDERS)["providers"]
    assert f"./deploy/grafana/dashboards:{provider['options']['path']}:ro" in grafana
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana
    assert "./deploy/prometheus:/etc/prometheus:ro" in set(services["prometheus"].get("volumes", []))


# ---------------------------------------------------------------- the dashboard's shape

def test_every_panel_has_a_query_on_the_provisioned_datasource(dashboard: dict[str, Any]) -> None:
    uid = _datasource_uid()
    panels = _query_panels(dashboard)
    assert len(panels) >= 12
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": uid}, panel["title"]
        targets = panel.get("targets", [])
        assert targets and all(t.get("expr", "").strip() for t in targets), panel["title"]
        for target in targets:
            assert target.get("datasource", panel["datasource"]) == panel["datasource"], panel["title"]
        assert len({t["refId"] for t in targets}) == len(targets), panel["title"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == uid, variable["name"]


def test_layout(dashboard: dict[str, Any]) -> None:
    panels = list(iter_panels(dashboard))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    assert dashboard["uid"] and dashboard["title"]
    for panel in panels:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        assert panel.get("title"), panel["id"]


def test_model_name_variable(dashboard: dict[str, Any]) -> None:
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "model_name"]
    assert variable["includeAll"] and variable["multi"] and variable["allValue"] == ".*"
    query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
    assert re.fullmatch(r"label_values\(.+,\s*model_name\)", query), query


def test_every_specdec_selector_goes_through_the_model_variable(dashboard: dict[str, Any]) -> None:
    for panel in _query_panels(dashboard):
        for target in panel["targets"]:
            expr = target["expr"]
            for match in re.finditer(r"\b(specdec_\w+)(\{[^}]*\})?", expr):
                assert match[2] and 'model_name=~"$model_name"' in match[2], f"{panel['title']}: {match[0]}"


def test_queries_use_documented_raw_metrics_only() -> None:
    documented = documented_series_names()
    for title, expr in panel_queries():
        used = metric_names(expr)
        assert used, f"{title}: no metric in {expr!r}"
        assert used <= documented, f"{title}: undocumented {sorted(used - documented)} in {expr!r}"


def test_dashboard_covers_the_issue() -> None:
    """The panels issues 9 and 55 ask for: each needs these metrics somewhere in the dashboard."""
    used = {name for _, expr in panel_queries() for name in metric_names(expr)}
    required = {
        "acceptance rate": {"specdec_spec_decode_num_accepted_tokens_total",
                            "specdec_spec_decode_num_draft_tokens_total"},
        "mean acceptance length": {"specdec_spec_decode_num_drafts_total"},
        "per-position acceptance": {"specdec_spec_decode_num_accepted_tokens_per_pos_total"},
        "tokens/s": {"specdec_generation_tokens_total"},
        "TTFT": {"specdec_time_to_first_token_seconds_bucket"},
        "inter-token latency": {"specdec_inter_token_latency_seconds_bucket"},
        "running and waiting": {"specdec_num_requests_running", "specdec_num_requests_waiting"},
        "KV usage": {"specdec_service_kv_blocks", "specdec_service_kv_blocks_total", "specdec_kv_cache_usage_perc"},
        "RPC latency": {"specdec_rpc_latency_seconds_bucket", "specdec_service_rpc_latency_seconds_bucket"},
        "draft failures": {"specdec_spec_decode_draft_failures_total"},
        "speculation off": {"specdec_spec_decode_off_rounds_total"},
        "planner (issue 55)": {"specdec_spec_decode_source_state", "specdec_spec_decode_source_switches_total",
                               "specdec_spec_decode_off_seconds", "specdec_spec_decode_source_off_seconds",
                               "specdec_spec_decode_planner_acceptance", "specdec_spec_decode_planner_draft_cost_ratio",
                               "specdec_spec_decode_planner_expected_speedup"},
    }
    by_source = [expr for _, expr in panel_queries() if "by (model_name, source)" in expr]
    assert {"specdec_spec_decode_num_draft_tokens_total", "specdec_spec_decode_num_accepted_tokens_total"} <= {
        name for expr in by_source for name in metric_names(expr)}, "no panel per draft source"
    for topic, names in required.items():
        assert names <= used, f"{topic}: {sorted(names - used)} not on the dashboard"
    for histogram in ("specdec_time_to_first_token_seconds", "specdec_inter_token_latency_seconds"):
        quantiles = {float(q) for _, expr in panel_queries()
                     for q in re.findall(rf"histogram_quantile\(([0-9.]+),[^\n]*{histogram}_bucket", expr)}
        assert {0.5, 0.95, 0.99} <= quantiles, histogram


def test_panel_queries_substitute_every_variable() -> None:
    queries = panel_queries()
    assert len(queries) >= len(_query_panels(load_dashboard()))
    for title, expr in queries:
        assert "$" not in expr, title
    concrete = panel_queries(variables={"model_name": TARGET_MODEL}, rate_interval="30s")
    assert len(concrete) == len(queries)
    assert any(f'model_name=~"{TARGET_MODEL}"' in expr for _, expr in concrete)
    assert any("[30s]" in expr for _, expr in concrete)
    windows = {w for _, expr in concrete for w in re.findall(r"\[(\w+)\]", expr)}
    assert windows <= {"30s", "1m", "5m"}, windows  # $__rate_interval, or a window the panel fixes
    assert variable_defaults(load_dashboard()) == {"model_name": ".*"}


# ---------------------------------------------------------------- every query returns series

_BUCKETS = ("0.001", "0.01", "0.1", "1", "10", "+Inf")
_BUCKET_SHARE = (1, 3, 6, 8, 9, 10)  # cumulative observations per bucket, of 10
_DEFAULT_VALUES = {  # labels whose values docs/metrics.md does not list in the table
    "position": ("0", "1", "2", "3"),
    "method": ("Prefill", "Verify", "Propose"),
    "code": ("UNAVAILABLE", "RESOURCE_EXHAUSTED"),
    # cache_config_info: one pool's shape
    "block_size": ("16",), "num_gpu_blocks": ("1024",), "kv_cache_size_tokens": ("16384",),
    "cache_dtype": ("bfloat16",), "device": ("cpu",),
}
_SAMPLES = 41  # 10 minutes at 15 s


def _label_sets(metric: DocumentedMetric, job: str) -> Iterator[dict[str, str]]:
    base = {"job": job, "instance": f"{job}:9090", "model_name": DRAFT_MODEL if job == "draft" else TARGET_MODEL}
    sets = [base]
    for label in metric.labels:
        if label == "service" and metric.exporter == "service":
            values: tuple[str, ...] = (job,)
        else:
            values = metric.label_values.get(label) or _DEFAULT_VALUES[label]
        sets = [{**s, label: v} for s in sets for v in values]
    yield from sets


def _series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    matchers = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{matchers}}}", "values": values}


def _input_series(loaded: bool) -> list[dict[str, str]]:
    """The three services' exports: at start-up (every counter 0) or under load."""
    def grow(step: float) -> str:
        return f"0+{step}x{_SAMPLES - 1}" if loaded else f"0x{_SAMPLES - 1}"

    out = []
    for metric in documented_metrics():
        jobs = ["gateway"] if metric.exporter == "gateway" else ["target", "draft"]
        for job in jobs:
            for labels in _label_sets(metric, job):
                if metric.name.endswith("_service_rpc_errors_total") and not loaded:
                    continue  # a family may appear only once something happened: queries must still answer
                if metric.type == "histogram":
                    for le, share in zip(_BUCKETS, _BUCKET_SHARE):
                        out.append(_series(f"{metric.name}_bucket", {**labels, "le": le}, grow(share)))
                    out.append(_series(f"{metric.name}_sum", labels, grow(2.5)))
                    out.append(_series(f"{metric.name}_count", labels, grow(10)))
                elif metric.type == "counter":
                    out.append(_series(metric.name, labels, grow(5)))
                else:
                    value = {"free": 900, "used": 100}.get(labels.get("state", ""),
                                                           1000 if metric.name.endswith("_total") else 0.5)
                    out.append(_series(metric.name, labels, f"{value}x{_SAMPLES - 1}"))
    for job in SCRAPE_JOBS:
        labels = {"job": job, "instance": f"{job}:9090"}
        out.append(_series("up", labels, f"1x{_SAMPLES - 1}"))
        out.append(_series(PROCESS_METRICS[0], labels, f"0+1.5x{_SAMPLES - 1}"))
        for name in PROCESS_METRICS[1:]:
            out.append(_series(name, labels, f"1000x{_SAMPLES - 1}"))
    return out


def _write_query_rules(path: Path, queries: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """One alert per query that fires when the query returns at least one series."""
    alerts = [{"alert": f"DashboardQuery{i:03d}", "expr": f"count(\n{expr}\n) > 0", "labels": {"panel": title}}
              for i, (title, expr) in enumerate(queries)]
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": alerts}]}, sort_keys=False))
    return alerts


@needs_promtool
def test_every_query_parses(tmp_path: Path) -> None:
    rules = tmp_path / "dashboard_rules.yml"
    _write_query_rules(rules, panel_queries())
    result = run_promtool("check", "rules", rules)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
@pytest.mark.parametrize("loaded", [False, True], ids=["at-start-up", "under-load"])
# "All", and both models picked by hand (Grafana renders a multi-value pick as `(a|b)`).
@pytest.mark.parametrize("model", [None, f"({TARGET_MODEL}|{DRAFT_MODEL})"], ids=["all-models", "both-models-picked"])
def test_every_query_returns_series(tmp_path: Path, loaded: bool, model: str | None) -> None:
    queries = panel_queries(variables={"model_name": model} if model else None, rate_interval="1m")
    rules = tmp_path / "dashboard_rules.yml"
    alerts = _write_query_rules(rules, queries)
    # The model variable's query must offer both models (gateway series carry the target's).
    alerts.append({"alert": "ModelNameValues", "expr": 'count by (model_name) ({__name__=~"specdec_.+"}) > 0'})
    rules.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": alerts}]}, sort_keys=False))
    cases: list[dict[str, Any]] = [
        {"eval_time": "10m", "alertname": alert["alert"], "exp_alerts": [{"exp_labels": alert["labels"]}]}
        for alert in alerts if alert["alert"] != "ModelNameValues"
    ]
    cases.append({"eval_time": "10m", "alertname": "ModelNameValues",
                  "exp_alerts": [{"exp_labels": {"model_name": m}} for m in (TARGET_MODEL, DRAFT_MODEL)]})
    test = {
        "rule_files": [rules.name],
        "evaluation_interval": "1m",
        "tests": [{"interval": "15s", "input_series": _input_series(loaded), "alert_rule_test": cases}],
    }
    test_file = tmp_path / "dashboard_test.yml"
    test_file.write_text(yaml.safe_dump(test, sort_keys=False))
    result = run_promtool("test", "rules", test_file, cwd=tmp_path)
    output = result.stdout + result.stderr
    empty = sorted({title for title, expr in queries
                    if re.search(rf"panel=\"{re.escape(title)}\"", output)}) if result.returncode else []
    assert result.returncode == 0, f"queries that returned no series: {empty}\n{output[-6000:]}"


def test_dashboard_json_file() -> None:
    text = DASHBOARD.read_text()
    assert text.endswith("}\n")
    assert json.loads(text)["id"] is None  # provisioned dashboards carry no database id
