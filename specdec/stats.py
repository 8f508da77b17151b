"""Plain statistics and their Prometheus exporter, kept apart.

Services record what happens into plain objects (ints, floats and `Distribution`s, no
Prometheus import); a `MetricsEndpoint` renders them at scrape time through a collector
the service supplies. Rendering at scrape time lets one stats object serve any metric
prefix (`specdec_`, or `vllm:` for drop-in vLLM dashboards) and means every label value
exists from the first scrape, since the stats hold all of them from the start.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    ProcessCollector,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from specdec.errors import InvalidArgumentError

#: 1 ms to 20 minutes: requests on a loaded CPU take minutes, single steps milliseconds.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0,
)
#: Tokens per request or per forward pass.
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
#: Requests per batched call.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
DEFAULT_PREFIX = "specdec_"
_METRIC_PREFIX = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def check_metrics_prefix(prefix: str) -> None:
    if not _METRIC_PREFIX.fullmatch(prefix):
        raise InvalidArgumentError(f"metrics_prefix: {prefix!r} cannot start a Prometheus metric name",
                                   field="metrics_prefix")


@dataclass
class Distribution:
    """A histogram as plain numbers: cumulative-ready bucket counts, sum and count."""

    bounds: Sequence[float]
    counts: list[int] = field(default_factory=list)  # one per bound, plus +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def buckets(self) -> list[tuple[str, float]]:
        """(le, cumulative count) pairs, ending with +Inf, as Prometheus wants them."""
        out, running = [], 0
        for bound, n in zip([*map(str, self.bounds), "+Inf"], self.counts):
            running += n
            out.append((bound, float(running)))
        return out


class Families:
    """Builds metric families with one prefix and constant labels (e.g. model_name)."""

    def __init__(self, prefix: str, const_labels: Mapping[str, str]) -> None:
        self.prefix = prefix
        self.const_names = list(const_labels)
        self.const_values = list(const_labels.values())

    def counter(self, name: str, doc: str, labels: Sequence[str], values: Mapping[tuple[str, ...], float]) -> Metric:
        family = CounterMetricFamily(self.prefix + name, doc, labels=[*self.const_names, *labels])
        for key, value in values.items():
            family.add_metric([*self.const_values, *key], value)
        return family

    def gauge(self, name: str, doc: str, labels: Sequence[str], values: Mapping[tuple[str, ...], float]) -> Metric:
        family = GaugeMetricFamily(self.prefix + name, doc, labels=[*self.const_names, *labels])
        for key, value in values.items():
            family.add_metric([*self.const_values, *key], value)
        return family

    def histogram(self, name: str, doc: str, labels: Sequence[str],
                  values: Mapping[tuple[str, ...], Distribution]) -> Metric:
        family = HistogramMetricFamily(self.prefix + name, doc, labels=[*self.const_names, *labels])
        for key, dist in values.items():
            family.add_metric([*self.const_values, *key], dist.buckets(), dist.total)
        return family


class _CallbackCollector(Collector):
    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterable[Metric]:
        return self._collect()


#: The content type of `MetricsEndpoint.exposition`.
METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST


class MetricsEndpoint:
    """A registry with the process collector and a service's own collector, served over HTTP."""

    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.registry.register(_CallbackCollector(collect))
        self._http: WSGIServer | None = None

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format, for a front that serves /metrics itself."""
        return generate_latest(self.registry)

    def serve(self, port: int, host: str) -> int:
        """Start the /metrics HTTP endpoint; returns the bound port."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http.server_port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
