"""A real Prometheus (Debian's, installed by `make test`) scraping a running stack of three
services on loopback: every target is up, the PromQL acceptance figures equal what the
gateway's final messages report, and every Grafana panel's query returns series."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from specdec.model.runtime import ModelRuntime
from tests.support.dashboard_queries import DASHBOARD, panel_queries
from tests.support.prometheus_deploy import write_prometheus_config
from tests.support.stacks import StartStack

SCRAPE_S = 1
WINDOW = "15m"  # longer than the test: the rates cover the whole run
CHAT = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict[str, Any]]:
        params = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{params}", timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def scalar(self, expr: str) -> float:
        result = self.query(expr)
        assert len(result) == 1, (expr, result)
        return float(result[0]["value"][1])


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[Mapping[str, int | None]], Prometheus]]:
    """`prometheus({job: metrics_port})` starts Prometheus scraping those loopback ports, with the
    deployment's prometheus.yml and rule files."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("Debian's prometheus is not installed (`make test` installs it)")
    processes: list[subprocess.Popen[bytes]] = []

    def start(jobs: Mapping[str, int | None]) -> Prometheus:
        config = write_prometheus_config(
            tmp_path / "prometheus.yml", {job: f"127.0.0.1:{port}" for job, port in jobs.items()},
            scrape_interval=f"{SCRAPE_S}s", evaluation_interval=f"{SCRAPE_S}s",
        )
        port = _free_port()
        log = (tmp_path / "prometheus.log").open("wb")
        processes.append(subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT,
        ))
        server = Prometheus(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2):
                    return server
            except OSError:
                assert processes[-1].poll() is None, (tmp_path / "prometheus.log").read_text()
                assert time.monotonic() < deadline, "prometheus did not become ready"
                time.sleep(0.2)

    yield start
    for process in processes:
        process.terminate()
        process.wait(30)


def _wait_for(check: Callable[[], object], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


def test_prometheus_sees_the_stack_and_agrees_with_the_final_messages(
    start_stack: StartStack, int8_runtime: ModelRuntime, prometheus: Callable[[Mapping[str, int | None]], Prometheus]
) -> None:
    stack = start_stack(int8_runtime, metrics_port=0, target={"metrics_port": 0}, draft={"metrics_port": 0})
    jobs = {"gateway": stack.gateway.metrics_port, "target": stack.servers[0].metrics_port,
            "draft": stack.servers[1].metrics_port}
    prom = prometheus(jobs)
    _wait_for(lambda: len(prom.query("up == 1")) == 3)  # a first scrape of every service, counters at zero

    with stack.client() as client:
        results = [
            client.generate(CHAT, max_new_tokens=24, num_speculative_tokens=4),
            client.generate(CHAT, max_new_tokens=16, temperature=0.8, seed=3, num_speculative_tokens=3),
            client.generate("Once upon a time", max_new_tokens=20, temperature=0.8, top_p=0.9, seed=5),
            client.generate(CHAT, max_new_tokens=8, speculative=False),
        ]
    stack.wait_until_idle()
    total = sum(r.completion_tokens for r in results)
    _wait_for(lambda: prom.query("specdec_generation_tokens_total")
              and prom.scalar("sum(specdec_generation_tokens_total)") == total)
    # The target's scrape after the last request may come later than the gateway's.
    target_verifies = 'sum(specdec_service_compute_seconds_count{service="target",method="Verify"})'
    _wait_for(lambda: prom.query(target_verifies) and prom.scalar(target_verifies) > 0)

    assert {r["metric"]["job"] for r in prom.query("up == 1")} == {"gateway", "target", "draft"}
    rounds = sum(r.num_rounds for r in results)
    drafted = sum(r.num_draft_tokens for r in results)
    accepted = sum(r.num_accepted_tokens for r in results)
    assert rounds > 0 and drafted > 0
    acceptance = prom.scalar(
        f"sum(rate(specdec_spec_decode_num_accepted_tokens_total[{WINDOW}]))"
        f" / sum(rate(specdec_spec_decode_num_draft_tokens_total[{WINDOW}]))"
    )
    mean_length = prom.scalar(
        f"1 + sum(rate(specdec_spec_decode_num_accepted_tokens_total[{WINDOW}]))"
        f" / sum(rate(specdec_spec_decode_num_drafts_total[{WINDOW}]))"
    )
    assert acceptance == pytest.approx(accepted / drafted, rel=1e-9)
    assert mean_length == pytest.approx(1 + accepted / rounds, rel=1e-9)
    # Each request's own figure is the same quantity, weighted the same way.
    assert sum(r.acceptance_rate * r.num_draft_tokens for r in results) == pytest.approx(accepted)
    if DASHBOARD.exists():  # every Grafana panel's query parses and returns series (once scraped enough)
        def empty() -> list[tuple[str, str]]:
            return [(title, expr) for title, expr in panel_queries(DASHBOARD) if not prom.query(expr)]

        missing, deadline = empty(), time.monotonic() + 120
        while missing and time.monotonic() < deadline:
            time.sleep(0.5)
            missing = empty()
        assert missing == [], missing
