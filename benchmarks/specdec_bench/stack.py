"""The measured system: target, draft and gateway as three processes, as in production.

`target_server` and then `draft_server` start through `specdec.cli.launcher` with the
services' own defaults plus any extra flags; the gateway (`python -m specdec.gateway`) starts once
both listen, with its Prometheus endpoint on a free port. The benchmark process only
sends requests (and, while the stack idles, runs the transformers peers).
"""

from __future__ import annotations

import shlex
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
from prometheus_client.parser import text_string_to_metric_families

from specdec.cli.launcher import ServiceProcess, start_service
from specdec.draft_server.config import DraftConfig
from specdec.flags import parse_config
from specdec.target_server.config import TargetConfig
from specdec.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc

#: How long a service may take to load the compiled graphs its start-up left for later.
GRAPHS_TIMEOUT_S = 600.0
#: How long a service may take to print its ready line: a cold start (empty tuning and compile
#: caches) measures its kernels and builds graphs first, minutes on a busy 2-core machine.
START_TIMEOUT_S = 900.0
#: Quiet services: their INFO logs would interleave with the progress bar.
_QUIET = ("--log-level", "WARNING")


@dataclass(frozen=True)
class MetricsSnapshot:
    """The gateway's speculation counters at one moment."""

    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    #: Accepted draft tokens by position (0-based) in the draft.
    accepted_per_pos: dict[int, float]
    #: Draft tokens proposed, by draft source (`specdec.gateway.draft_sources.DraftSource` values).
    draft_tokens_by_source: dict[str, float] = field(default_factory=dict)
    #: Draft tokens grammars forced (`spec_decode_num_forced_tokens`).
    forced_tokens: float = 0.0

    def accepted_since(self, before: MetricsSnapshot, k: int) -> list[int]:
        """Accepted tokens per position 0..k-1 between `before` and this snapshot."""
        return [round(self.accepted_per_pos.get(j, 0.0) - before.accepted_per_pos.get(j, 0.0)) for j in range(k)]


@dataclass
class Stack:
    """The three running services and where to reach them."""

    target: ServiceProcess
    draft: ServiceProcess
    gateway: ServiceProcess
    metrics_port: int
    target_config: TargetConfig
    draft_config: DraftConfig
    #: A second gateway on the same target without the draft (lookup drafting only), if started.
    lookup_gateway: ServiceProcess | None = None

    @property
    def address(self) -> str:
        return self.gateway.address

    @property
    def lookup_address(self) -> str:
        if self.lookup_gateway is None:
            raise RuntimeError("the stack was started without a lookup-only gateway")
        return self.lookup_gateway.address

    def metrics(self) -> MetricsSnapshot:
        """Scrape the gateway's /metrics endpoint."""
        return scrape_metrics(self.metrics_port)


def scrape_metrics(port: int) -> MetricsSnapshot:
    """The speculation counters of the gateway whose Prometheus endpoint listens on `port`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    by_source: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            # The speculation counters are per draft source: summed here over the sources.
            if sample.name == "specdec_spec_decode_num_accepted_tokens_per_pos_total":
                position = int(sample.labels["position"])
                per_pos[position] = per_pos.get(position, 0.0) + sample.value
            elif set(sample.labels) <= {"model_name", "source"}:  # every series carries model_name
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
                if sample.name == "specdec_spec_decode_num_draft_tokens_total" and "source" in sample.labels:
                    source = sample.labels["source"]
                    by_source[source] = by_source.get(source, 0.0) + sample.value
    return MetricsSnapshot(
        num_drafts=values.get("specdec_spec_decode_num_drafts_total", 0.0),
        num_draft_tokens=values.get("specdec_spec_decode_num_draft_tokens_total", 0.0),
        num_accepted_tokens=values.get("specdec_spec_decode_num_accepted_tokens_total", 0.0),
        accepted_per_pos=per_pos, draft_tokens_by_source=by_source,
        forced_tokens=values.get("specdec_spec_decode_num_forced_tokens_total", 0.0),
    )


#: The harness measures the draft model (α, c and efficiency against Thm 3.8): requests draft
#: with it alone unless `gateway_args` names another `--speculation-method` (the later flag wins).
MODEL_DRAFT = ("--speculation-method", "model")
#: Every prompt is sent more than once (per method and repetition): the cross-request suffix
#: cache would copy an earlier identical answer, which says nothing about distinct requests.
NO_SUFFIX_CACHE = ("--suffix-cache-tokens", "0")


@contextmanager
def running_stack(
    target_args: str = "", draft_args: str = "", gateway_args: str = "", *, lookup_gateway: bool = False,
    wait_graphs: bool = True,
) -> Iterator[Stack]:
    """Start target, draft and gateway, one after the other (and, with `lookup_gateway`, a second
    gateway on the same target without the draft, `--speculation-method ngram`); stop all on exit.
    With `wait_graphs` the gateway starts once both services have loaded their deferred compiled
    graphs (`wait_for_graphs`); without, as soon as they listen, as in production."""
    target_flags, draft_flags = shlex.split(target_args), shlex.split(draft_args)
    configs = parse_config(TargetConfig, target_flags), parse_config(DraftConfig, draft_flags)
    children: list[ServiceProcess] = []
    try:
        # One after the other, unlike `specdec serve`: each service times its forward pass at
        # start-up, and on a 2-core machine two services loading and timing at once corrupt
        # each other's cost tables (and with them c, s and the gateway's choice of K).
        children.append(start_service("specdec.target_server", [*_QUIET, *target_flags]))
        target = children[-1].wait_ready(START_TIMEOUT_S)
        children.append(start_service("specdec.draft_server", [*_QUIET, *draft_flags]))
        draft = children[-1].wait_ready(START_TIMEOUT_S)
        if wait_graphs:
            wait_for_graphs(target.address, "target")
            wait_for_graphs(draft.address, "draft")
        children.append(start_service("specdec.gateway", [
            "--target-address", target.address, "--draft-address", draft.address, "--metrics-port", "0", *_QUIET,
            *MODEL_DRAFT, *NO_SUFFIX_CACHE, *shlex.split(gateway_args),
        ]))
        gateway = children[-1].wait_ready(START_TIMEOUT_S)
        metrics_port = gateway.ready.metrics_port if gateway.ready is not None else None
        if metrics_port is None:
            raise RuntimeError(f"the gateway's ready line names no metrics port: {gateway.ready}")
        lookup_only = None
        if lookup_gateway:
            # Its own instance name (port 0 picks a random one), so the two gateways' slots differ.
            children.append(start_service("specdec.gateway", [
                "--target-address", target.address, *_QUIET, *NO_SUFFIX_CACHE, *shlex.split(gateway_args),
                "--speculation-method", "ngram",
            ]))
            lookup_only = children[-1].wait_ready(START_TIMEOUT_S)
        yield Stack(target, draft, gateway, metrics_port, *configs, lookup_gateway=lookup_only)
    finally:
        for child in reversed(children):
            child.stop()


@contextmanager
def second_gateway(stack: Stack, gateway_args: str, *flags: str) -> Iterator[ServiceProcess]:
    """Another gateway on the stack's target and draft, started as the stack's own with `flags`
    after its flags (the later flag wins), its Prometheus endpoint on a free port; stopped on exit."""
    child = start_service("specdec.gateway", [
        "--target-address", stack.target.address, "--draft-address", stack.draft.address, "--metrics-port", "0",
        *_QUIET, *MODEL_DRAFT, *NO_SUFFIX_CACHE, *shlex.split(gateway_args), *flags,
    ])
    try:
        yield child.wait_ready(START_TIMEOUT_S)
    finally:
        child.stop()


def pending_graphs(address: str, service: str) -> int:
    """The compiled graphs the `service` ("target" or "draft") at `address` still has to load
    (`ModelInfo.pending_graphs`): until it has, some of its steps run eager."""
    with grpc.insecure_channel(address) as channel:
        stub: target_pb2_grpc.TargetServiceStub | draft_pb2_grpc.DraftServiceStub
        if service == "target":
            stub = target_pb2_grpc.TargetServiceStub(channel)
        else:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
        return stub.Info(common_pb2.InfoRequest(), timeout=30).pending_graphs


def wait_for_graphs(address: str, service: str, timeout: float = GRAPHS_TIMEOUT_S) -> None:
    """Block until the `service` ("target" or "draft") at `address` has loaded the compiled
    graphs its start-up left for after serving began (`pending_graphs`): until then its steps
    run eager and it compiles or times beside the benchmark."""
    deadline = time.monotonic() + timeout
    while (pending := pending_graphs(address, service)) > 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the {service} still had {pending} compiled graphs to load after {timeout:.0f} s")
        time.sleep(0.5)
