"""deploy/prometheus: the scrape configuration, the recording and alerting rules, and their
promtool unit tests (deploy/prometheus/tests/*.yml).

The promtool tests skip when promtool is missing (Debian's `prometheus` package; `make test`
installs it). The rest is plain YAML and runs everywhere.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.dashboard_queries import metric_names
from tests.support.prometheus_deploy import (
    PROMETHEUS_CONFIG,
    PROMETHEUS_DIR,
    RULE_TESTS_DIR,
    RULES_DIR,
    SCRAPE_JOBS,
    documented_series_names,
    load_yaml,
    needs_promtool,
    render_prometheus_config,
    rule_files,
    rule_tests,
    rules,
    run_promtool,
    write_prometheus_config,
)

SEVERITIES = {"critical", "warning"}


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


# ---------------------------------------------------------------- promtool

@needs_promtool
def test_deployed_config_is_valid_with_its_rule_files(tmp_path: Path) -> None:
    """prometheus.yml as docker-compose mounts it: a folder with rules/ beside the config."""
    mounted = tmp_path / "etc-prometheus"
    mounted.mkdir()
    shutil.copy(PROMETHEUS_CONFIG, mounted / "prometheus.yml")
    shutil.copytree(RULES_DIR, mounted / "rules")
    output = _ok(run_promtool("check", "config", "prometheus.yml", cwd=mounted))
    for path in rule_files():  # the relative glob found every rule file
        assert f"rules/{path.name}" in output, output


@needs_promtool
def test_loopback_config_loads_the_same_rule_files(tmp_path: Path) -> None:
    targets = {"gateway": "127.0.0.1:19464", "target": "127.0.0.1:19465", "draft": "127.0.0.1:19466"}
    config = write_prometheus_config(tmp_path / "prometheus.yml", targets, scrape_interval="1s",
                                     evaluation_interval="1s")
    output = _ok(run_promtool("check", "config", config, cwd=tmp_path))
    for path in rule_files():
        assert str(path) in output, output


@needs_promtool
def test_rule_files_are_valid() -> None:
    output = _ok(run_promtool("check", "rules", *rule_files()))
    assert output.count("SUCCESS") == len(rule_files())


@needs_promtool
def test_rule_unit_tests_pass() -> None:
    tests = sorted(RULE_TESTS_DIR.glob("*.yml"))
    assert tests
    output = _ok(run_promtool("test", "rules", *tests))
    assert "FAILED" not in output, output


# ---------------------------------------------------------------- coverage of the unit tests

def test_every_alert_is_tested_firing_and_not_firing() -> None:
    firing: set[str] = set()
    silent: set[str] = set()
    for group in rule_tests():
        for case in group.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else silent).add(case["alertname"])
    names = {rule["alert"] for rule in rules("alert")}
    assert names, "no alerting rules"
    assert names <= firing, f"alerts never tested firing: {sorted(names - firing)}"
    assert names <= silent, f"alerts never tested not firing: {sorted(names - silent)}"
    assert (firing | silent) <= names, f"tests of unknown alerts: {sorted((firing | silent) - names)}"


def test_every_recording_rule_is_tested() -> None:
    tested = {name for group in rule_tests() for case in group.get("promql_expr_test", [])
              for name in metric_names(case["expr"])}
    names = {rule["record"] for rule in rules("record")}
    assert names, "no recording rules"
    assert names <= tested, f"recording rules without a promql_expr_test: {sorted(names - tested)}"


# ---------------------------------------------------------------- the rules themselves

def test_alerts_have_a_severity_and_annotations() -> None:
    for rule in rules("alert"):
        assert rule.get("labels", {}).get("severity") in SEVERITIES, rule["alert"]
        annotations = rule.get("annotations", {})
        assert annotations.get("summary") and annotations.get("description"), rule["alert"]
        assert "for" in rule, f"{rule['alert']} fires on a single evaluation"


def test_required_alerts_exist() -> None:
    exprs = {rule["alert"]: rule["expr"] for rule in rules("alert")}
    joined = "\n".join(exprs.values())
    assert 'up{job="target"} == 0' in joined  # target not serving
    assert 'up{job="draft"} == 0' in joined  # draft down
    assert 'specdec_spec_decode_off_rounds_total{reason="draft_unavailable"}' in joined
    assert "specdec_spec_decode_draft_failures_total" in joined
    assert "specdec_spec_decode_num_accepted_tokens_total" in joined  # low acceptance
    assert "specdec_service_kv_blocks_total" in joined and "specdec_kv_cache_usage_perc" in joined  # KV nearly full
    assert "specdec_spec_decode_off_seconds > 600" in exprs["SpecdecSpeculationOff"]  # the planner keeps it off


def test_recording_rule_names() -> None:
    for rule in rules("record"):
        assert re.fullmatch(r"specdec:[a-z0-9_]+:[a-z0-9_]+", rule["record"]), rule["record"]


def test_rules_use_documented_metrics() -> None:
    documented = documented_series_names()
    recorded = {rule["record"] for rule in rules("record")}
    for rule in rules("alert") + rules("record"):
        used = metric_names(rule["expr"])
        assert used, rule
        assert used <= documented | recorded, (f"{rule.get('alert') or rule.get('record')}: "
                                               f"{sorted(used - documented - recorded)}")
    for rule in rules("alert"):  # alerts stand alone: they work without recording.yml
        assert not metric_names(rule["expr"]) & recorded, rule["alert"]


# ---------------------------------------------------------------- prometheus.yml

def test_scrape_jobs_and_rule_files() -> None:
    config = load_yaml(PROMETHEUS_CONFIG)
    jobs = {scrape["job_name"]: scrape for scrape in config["scrape_configs"]}
    assert set(jobs) == set(SCRAPE_JOBS)
    for job, scrape in jobs.items():
        assert scrape["static_configs"] == [{"targets": [f"{job}:9090"]}]
    assert config["rule_files"] == ["rules/*.yml"]
    assert config["global"]["scrape_interval"] == "5s"


def test_rendered_config_for_loopback() -> None:
    config = render_prometheus_config({"gateway": "127.0.0.1:1", "target": ["127.0.0.1:2", "127.0.0.1:3"]},
                                      scrape_interval="1s")
    assert [s["job_name"] for s in config["scrape_configs"]] == ["gateway", "target"]  # draft left out
    assert config["scrape_configs"][1]["static_configs"] == [{"targets": ["127.0.0.1:2", "127.0.0.1:3"]}]
    assert config["rule_files"] == [str(PROMETHEUS_DIR.resolve() / "rules" / "*.yml")]
    assert config["global"]["scrape_interval"] == "1s"
    with pytest.raises(KeyError):
        render_prometheus_config({"gatewya": "127.0.0.1:1"})
