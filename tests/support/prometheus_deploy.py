"""What the deploy/ monitoring tests share: paths, promtool, the documented metric names,
and a copy of deploy/prometheus/prometheus.yml rendered for a stack on loopback.

An end-to-end test starts Prometheus with the same rule files as the deployment:

    from tests.support.prometheus_deploy import write_prometheus_config
    config = write_prometheus_config(tmp_path / "prometheus.yml",
                                     {"gateway": f"127.0.0.1:{gw_port}", "target": ..., "draft": ...},
                                     scrape_interval="1s")
    # prometheus --config.file={config} --storage.tsdb.path={tmp_path / "data"} --web.listen-address=127.0.0.1:0 ...
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
METRICS_DOC = REPO / "docs" / "metrics.md"

PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
PROMETHEUS_CONFIG = PROMETHEUS_DIR / "prometheus.yml"
RULES_DIR = PROMETHEUS_DIR / "rules"
RULE_TESTS_DIR = PROMETHEUS_DIR / "tests"

GRAFANA_DIR = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA_DIR / "dashboards" / "specdec.json"
DATASOURCES = GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = GRAFANA_DIR / "provisioning" / "dashboards" / "specdec.yml"

PREFIX = "specdec_"
#: Scrape job names; alerts select on them (`up{job="target"}`).
SCRAPE_JOBS = ("gateway", "target", "draft")
#: The standard process collector every service exports unprefixed (docs/metrics.md names
#: it in prose, not in a table); these series carry no model_name.
PROCESS_METRICS = ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds")
#: Series Prometheus adds to every scrape target.
SYNTHETIC_METRICS = ("up",)


def promtool() -> str | None:
    """Path of promtool (Debian's `prometheus` package), or None."""
    return shutil.which("promtool")



needs_promtool = pytest.mark.skipif(
    promtool() is None, reason="promtool is not installed (apt-get install prometheus; `make test` installs it)"
)

def run_promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    binary = promtool()
    if binary is None:
        raise FileNotFoundError("promtool is not installed (apt-get install prometheus)")
    return subprocess.run([binary, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120)


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


# ---------------------------------------------------------------- docs/metrics.md

@dataclass(frozen=True)
class DocumentedMetric:
    """One row of a table in docs/metrics.md."""

    name: str  # with the prefix, as exported: specdec_spec_decode_num_drafts_total
    type: str  # counter, gauge or histogram
    exporter: str  # "gateway" or "service" (target and draft)
    labels: tuple[str, ...]  # besides model_name
    #: Label values the table lists, e.g. {"state": ("free", "used")}; labels without a list are absent.
    label_values: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def series_names(self) -> tuple[str, ...]:
        """Names of the series Prometheus stores for this family."""
        if self.type == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


_SECTIONS = {"gateway": "gateway", "target and draft services": "service"}
_ROW = re.compile(r"^\|\s*`(?P<name>[a-z0-9_]+)`\s*\|\s*(?P<type>counter|gauge|histogram)\s*\|(?P<labels>[^|]*)\|")
_LABEL = re.compile(r"`(?P<label>\w+)`(?:\s*\((?P<values>[^)]*)\))?")


def documented_metrics(path: Path = METRICS_DOC, prefix: str = PREFIX) -> list[DocumentedMetric]:
    """Every metric family in the tables of docs/metrics.md, in order."""
    metrics: list[DocumentedMetric] = []
    exporter: str | None = None
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            exporter = _SECTIONS.get(line[3:].strip().lower())
            continue
        row = _ROW.match(line)
        if row is None or exporter is None:
            continue
        labels: list[str] = []
        values: dict[str, tuple[str, ...]] = {}
        for label in _LABEL.finditer(row["labels"]):
            labels.append(label["label"])
            listed = tuple(v.strip() for v in (label["values"] or "").split(","))
            if listed and all(re.fullmatch(r"\w+", v) for v in listed):  # "(0-based)" is prose, not values
                values[label["label"]] = listed
        metrics.append(DocumentedMetric(prefix + row["name"], row["type"], exporter, tuple(labels), values))
    return metrics


def documented_series_names(path: Path = METRICS_DOC) -> set[str]:
    """Every series name a query may use: the tables' families, process_*, and `up`."""
    names = {name for metric in documented_metrics(path) for name in metric.series_names}
    return names | set(PROCESS_METRICS) | set(SYNTHETIC_METRICS)


# ---------------------------------------------------------------- rules

def rule_files() -> list[Path]:
    return sorted(RULES_DIR.glob("*.yml"))


def rules(kind: str) -> list[dict[str, Any]]:
    """Every rule of deploy/prometheus/rules/*.yml with an `alert` or a `record` key (kind)."""
    return [rule for path in rule_files() for group in load_yaml(path)["groups"] for rule in group["rules"]
            if kind in rule]


def rule_tests() -> list[dict[str, Any]]:
    """Every test group of deploy/prometheus/tests/*.yml."""
    return [group for path in sorted(RULE_TESTS_DIR.glob("*.yml")) for group in load_yaml(path)["tests"]]


# ---------------------------------------------------------------- prometheus.yml for tests

def render_prometheus_config(
    targets: Mapping[str, str | Sequence[str]],
    *,
    scrape_interval: str | None = None,
    evaluation_interval: str | None = None,
) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with `targets` ({job: "host:port" or a list}) in place
    of the compose host names and the deployment's rule files by absolute path.

    Jobs missing from `targets` are dropped; a job that the deployment does not have is an error.
    """
    config: dict[str, Any] = load_yaml(PROMETHEUS_CONFIG)
    jobs = {scrape["job_name"] for scrape in config["scrape_configs"]}
    unknown = set(targets) - jobs
    if unknown:
        raise KeyError(f"no scrape job {sorted(unknown)} in {PROMETHEUS_CONFIG} (jobs: {sorted(jobs)})")
    scrapes = []
    for scrape in config["scrape_configs"]:
        if scrape["job_name"] not in targets:
            continue
        addresses = targets[scrape["job_name"]]
        scrape["static_configs"] = [{"targets": [addresses] if isinstance(addresses, str) else list(addresses)}]
        scrapes.append(scrape)
    config["scrape_configs"] = scrapes
    config["rule_files"] = [str((PROMETHEUS_DIR / pattern).resolve()) for pattern in config["rule_files"]]
    if scrape_interval is not None:
        config["global"]["scrape_interval"] = scrape_interval
        # A timeout longer than the interval is a configuration error.
        config["global"]["scrape_timeout"] = scrape_interval
    if evaluation_interval is not None:
        config["global"]["evaluation_interval"] = evaluation_interval
    return config


def write_prometheus_config(path: Path, targets: Mapping[str, str | Sequence[str]], **options: str | None) -> Path:
    """render_prometheus_config(...) written to `path`; returns `path`."""
    path.write_text(yaml.safe_dump(render_prometheus_config(targets, **options), sort_keys=False))
    return path
