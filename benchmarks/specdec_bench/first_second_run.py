"""Measure traffic from the first second (`specdec_bench.first_second` has the records and figures).

Two fresh stacks, one after the other (never two at once on a small machine), each started
as `running_stack` starts one but with its gateway up as soon as the services listen, as in
production: their compiled graphs load while they serve. t is the moment the gateway first
answers Info. The waited stack runs first, so that the first-second stack always starts from
a warm tuning cache: it then serves eager at once and loads its graphs on the side, as a
restarted service does (from a cold cache, a service builds them before it listens).
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone

import grpc

from specdec.client import SpecdecClient
from specdec_bench.config import BenchConfig
from specdec_bench.first_second import FIRST_SECOND, WAITED, FailedRequest, FirstSecondRun, StackTraffic
from specdec_bench.results import machine
from specdec_bench.stack import GRAPHS_TIMEOUT_S, Stack, pending_graphs, running_stack
from specdec_bench.sweeps import Progress
from specdec_bench.workloads import REQUEST_TIMEOUT_S, run_request

#: Seconds between two looks at the services' pending graphs.
GRAPH_POLL_S = 0.5
#: Failed requests in a row after which a stack is taken for broken (the run stops).
MAX_FAILURES_IN_A_ROW = 10


class GraphWatch:
    """From t on, in a thread: the graphs both services still have to load, first as they
    answered, then until none is left (`loaded_s`, seconds after t)."""

    def __init__(self, stack: Stack, t: float) -> None:
        self.services = {"target": stack.target.address, "draft": stack.draft.address}
        self.t = t
        self.pending: dict[str, int] = {}
        self.loaded_s: float | None = None
        self.loaded = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="graph-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        try:
            while not self._stop.is_set():
                counts = {name: pending_graphs(address, name) for name, address in self.services.items()}
                self.pending = self.pending or counts
                if not any(counts.values()):
                    self.loaded_s = time.monotonic() - self.t
                    return
                self._stop.wait(GRAPH_POLL_S)
        except Exception as error:  # noqa: BLE001 - reported; the traffic goes on without it
            print(f"first-second scenario: watching the compiled graphs failed: {error}", file=sys.stderr)
        finally:
            self.loaded.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def traffic_plan(prompts: int, plain_too: bool) -> Iterator[tuple[int, int | None]]:
    """(prompt, K) of each request in turn: the prompts cycled, speculative (K None, the
    gateway's adaptive K); with `plain_too` each prompt plain too, the order alternating as in W1."""
    for turn in itertools.count():
        prompt = turn % prompts
        if not plain_too:
            yield prompt, None
            continue
        yield from ((prompt, k) for k in ((0, None) if turn % 2 == 0 else (None, 0)))


def run_stack(
    name: str, config: BenchConfig, progress: Progress, outputs: dict[tuple[int, int | None], list[list[int]]]
) -> StackTraffic:
    """Start a fresh stack and send it the traffic of `name` (`FIRST_SECOND` or `WAITED`); the
    greedy outputs go to `outputs` by (prompt, K)."""
    waited = name == WAITED
    target_args, draft_args, gateway_args = config.service_args()
    progress.set_description(f"first second: starting the {name} stack")
    with running_stack(target_args, draft_args, gateway_args, wait_graphs=False) as stack, \
            SpecdecClient(stack.address, timeout=REQUEST_TIMEOUT_S) as client:
        client.info()
        t = time.monotonic()
        watch = GraphWatch(stack, t)
        try:
            if waited:
                progress.set_description("first second: the waited stack loads its graphs")
                if not watch.loaded.wait(GRAPHS_TIMEOUT_S) or watch.loaded_s is None:
                    raise TimeoutError(f"the waited stack's graphs did not all load within {GRAPHS_TIMEOUT_S:.0f} s")
                time.sleep(config.first_second_settle_s)
            traffic_from_s = time.monotonic() - t if waited else 0.0
            traffic = StackTraffic(name, traffic_from_s, {}, None)
            in_a_row = 0
            for prompt, k in traffic_plan(config.prompts, plain_too=waited):
                start_s = time.monotonic() - t
                if start_s >= traffic_from_s + config.first_second_span_s:
                    break
                progress.set_description(f"first second: {name} stack, {start_s - traffic_from_s:.0f} s "
                                         f"of {config.first_second_span_s:.0f}")
                try:
                    record, result = run_request(client, name, prompt, k, max_new_tokens=config.max_new_tokens,
                                                 repetition=len(traffic.requests))
                except (grpc.RpcError, RuntimeError) as error:
                    # Counted: a request that fails while the services warm up is part of the picture.
                    code = error.code().name if isinstance(error, grpc.Call) else str(error)
                    traffic.failures.append(FailedRequest(start_s, prompt, k, code))
                    in_a_row += 1
                    if in_a_row >= MAX_FAILURES_IN_A_ROW:
                        raise RuntimeError(f"the {name} stack failed {in_a_row} requests in a row, "
                                           f"the last with {code}") from error
                    continue
                in_a_row = 0
                record.start_s = start_s
                traffic.requests.append(record)
                outputs.setdefault((prompt, k), []).append(result.token_ids)
        finally:
            watch.stop()
        traffic.pending_graphs, traffic.graphs_loaded_s = watch.pending, watch.loaded_s
        return traffic


def measure_first_second(config: BenchConfig, command: str, progress: Progress) -> FirstSecondRun:
    """The scenario: the waited stack, then the first-second stack, and their greedy outputs
    checked against the waited stack's plain ones (counted, not fatal: a warming stack runs
    other kernels, and the speed figures stand either way)."""
    started = time.monotonic()
    outputs: dict[tuple[int, int | None], list[list[int]]] = {}
    stacks = [run_stack(WAITED, config, progress, outputs), run_stack(FIRST_SECOND, config, progress, outputs)]
    checked = mismatches = 0
    for (prompt, k), texts in outputs.items():
        reference = outputs.get((prompt, 0))
        if k is None and reference:
            checked += len(texts)
            mismatches += sum(tokens != reference[0] for tokens in texts)
    for stack in stacks:
        if stack.failures:
            print(f"first-second scenario: {len(stack.failures)} request(s) of the {stack.name} stack failed: "
                  + ", ".join(f"{f.error} at t + {f.start_s:.1f} s" for f in stack.failures), file=sys.stderr)
    if mismatches:
        print(f"*** first-second scenario: {mismatches} of {checked} greedy speculative outputs differ from plain "
              "decoding ***", file=sys.stderr)
    target_args, draft_args, gateway_args = config.service_args()
    meta = {
        "command": command,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "duration_s": time.monotonic() - started,
        "machine": machine(),
        "config": {"span_s": config.first_second_span_s, "window_s": config.first_second_window_s,
                   "settle_s": config.first_second_settle_s, "prompts": config.prompts,
                   "max_new_tokens": config.max_new_tokens, "target_args": target_args.strip(),
                   "draft_args": draft_args.strip(), "gateway_args": gateway_args.strip()},
    }
    return FirstSecondRun(meta, stacks, checked, mismatches)
