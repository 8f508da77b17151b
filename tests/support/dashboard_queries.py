"""The PromQL queries of the Grafana dashboard, ready to send to Prometheus.

    from tests.support.dashboard_queries import panel_queries
    for title, expr in panel_queries():                      # deploy/grafana/dashboards/specdec.json
        ...  # GET /api/v1/query?query=expr: it must parse and return series

Grafana's template variables are substituted: `$__rate_interval`, `$__interval` and
`$__range` by `rate_interval`; the dashboard's own variables (`$model_name`) by the value
given in `variables`, else by the variable's "All" value (`.*`). Values go in as they are:
they sit inside `=~` matchers, so pass a regex (a plain model name is one).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from tests.support.prometheus_deploy import DASHBOARD

#: Grafana's built-in interval variables, replaced by `rate_interval`.
INTERVAL_VARIABLES = ("__rate_interval", "__interval", "__range")
_VARIABLE = re.compile(r"\$(?:\{(?P<braced>\w+)(?::\w+)?\}|(?P<bare>\w+))")


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(Path(path).read_text())
    return dashboard


def iter_panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows included, and the panels inside collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def variable_defaults(dashboard: Mapping[str, Any]) -> dict[str, str]:
    """Each template variable's "All" value (`allValue`, else `.*`)."""
    return {v["name"]: v.get("allValue") or ".*" for v in dashboard.get("templating", {}).get("list", [])}


def substitute(expr: str, values: Mapping[str, str], rate_interval: str = "1m") -> str:
    """`expr` with every `$var` / `${var}` / `${var:format}` replaced; unknown variables raise KeyError."""

    def replace(match: re.Match[str]) -> str:
        name = match["braced"] or match["bare"]
        if name in INTERVAL_VARIABLES:
            return rate_interval
        if name not in values:
            raise KeyError(f"unknown template variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(replace, expr)


def panel_queries(
    dashboard_path: Path = DASHBOARD,
    variables: Mapping[str, str] | None = None,
    rate_interval: str = "1m",
) -> list[tuple[str, str]]:
    """(panel title, expr) for every query of every panel, template variables substituted.

    A panel with several queries appears once per query, in the dashboard's order.
    """
    dashboard = load_dashboard(dashboard_path)
    values = {**variable_defaults(dashboard), **(variables or {})}
    return [
        (panel["title"], substitute(target["expr"], values, rate_interval))
        for panel in iter_panels(dashboard)
        for target in panel.get("targets", [])
        if target.get("expr")
    ]


# ---------------------------------------------------------------- metric names in PromQL

_KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "inf", "nan", "atan2",
}
_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (not functions, keywords or label names).

    A lexical approximation that covers what dashboards and rules use: selectors with or
    without matchers, functions, aggregations with by/without, vector matching.
    """
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = _LABEL_LIST.sub(" ", text)
    names = set()
    for match in _IDENTIFIER.finditer(text):
        before = text[match.start() - 1] if match.start() else " "
        if before.isdigit() or before == ".":  # 1e-9, 0.95
            continue
        after = text[match.end():].lstrip()
        if after.startswith("(") or match.group().lower() in _KEYWORDS:
            continue
        names.add(match.group())
    return names
