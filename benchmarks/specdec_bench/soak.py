"""Soak: many mixed requests with cancellations while the draft is killed and stopped.

    python -m specdec_bench.soak                    # 1,000 requests at concurrency 16
    python -m specdec_bench.soak --requests 200     # shorter

The three services run as separate processes (`specdec_bench.stack.running_stack`). Requests
mix greedy (plain, fixed K, adaptive K) and sampled ones (temperature, top-k, top-p,
repetition penalty, stop strings); a fifth of them are cancelled by their client after a
few tokens. Partway through, the draft is killed with SIGKILL and restarted on the same
port, and later stopped with SIGSTOP for a few seconds. The run passes when:

* no request failed except those its client cancelled;
* every greedy output equals the solo plain run of its prompt (a prefix of it, of the
  requested length, or up to EOS);
* both services hold no slot and all their KV blocks are free afterwards;
* no process grew by more than `--max-rss-growth-mb` between the end of the warm-up and
  the end of the run.

`tests/gateway/test_soak.py` runs a short version.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import grpc
from tqdm import tqdm

from specdec.cli.launcher import ServiceProcess, start_service
from specdec.client import SpecdecClient, build_request
from specdec.prompt_lookup import common_prefix_length
from specdec.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc
from specdec_bench.results import cpu_model
from specdec_bench.stack import Stack, running_stack
from specdec_bench.workloads import PROMPTS, chat

#: Completion lengths the requests draw from; greedy references run to the longest.
LENGTHS = (16, 32, 48)
QUIET = ("--log-level", "WARNING")


@dataclass(frozen=True)
class SoakConfig:
    requests: int = 1000
    concurrency: int = 16
    cancel_fraction: float = 0.2
    seed: int = 0
    #: Fractions of the requests sent before the draft is killed (then restarted) / stopped.
    kill_draft_at: float = 0.35
    stop_draft_at: float = 0.7
    stop_seconds: float = 4.0
    prompts: int = len(PROMPTS)
    max_rss_growth_mb: float = 300.0
    gateway_args: str = "--max-queue 256"
    service_args: str = "--kv-token-budget 8192 --max-slots 64"


@dataclass
class Plan:
    """One request of the soak."""

    index: int
    prompt: str
    max_new_tokens: int
    options: dict[str, object]
    greedy: bool
    #: Cancel after this many streamed messages (None: run to the end).
    cancel_after: int | None


@dataclass
class SoakReport:
    config: SoakConfig
    cpu: str
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    greedy_checked: int = 0
    greedy_mismatches: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    latency_p50_s: float = 0.0
    latency_p95_s: float = 0.0
    kv_before: dict[str, tuple[int, int]] = field(default_factory=dict)  # service -> (free, total)
    kv_after: dict[str, tuple[int, int]] = field(default_factory=dict)
    slots_after: dict[str, int] = field(default_factory=dict)
    rss_mb: dict[str, dict[str, float]] = field(default_factory=dict)  # process -> start/peak/end
    events: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        lines = [
            f"CPU: {self.cpu}",
            f"requests {self.requests}: completed {self.completed}, cancelled by their client {self.cancelled}, "
            f"unexpected errors {sum(self.errors.values())} {self.errors or ''}",
            f"greedy outputs checked against solo runs: {self.greedy_checked}, mismatches {self.greedy_mismatches}",
            f"tokens {self.completion_tokens} in {self.wall_s:.1f} s "
            f"({self.completion_tokens / max(self.wall_s, 1e-9):.1f} tok/s); "
            f"request latency p50 {self.latency_p50_s:.2f} s, p95 {self.latency_p95_s:.2f} s",
            "KV free/total before → after: " + ", ".join(
                f"{name} {self.kv_before[name][0]}/{self.kv_before[name][1]} → {self.kv_after.get(name, (0, 0))[0]}/"
                f"{self.kv_after.get(name, (0, 0))[1]} ({self.slots_after.get(name, -1)} slots held)"
                for name in self.kv_before
            ),
            "RSS MB (start / peak / end): " + ", ".join(
                f"{name} {v['start']:.0f} / {v['peak']:.0f} / {v['end']:.0f}" for name, v in self.rss_mb.items()
            ),
            "events: " + "; ".join(self.events),
            "PASS" if self.ok else "FAIL: " + "; ".join(self.failures),
        ]
        return "\n".join(lines)


def make_plans(config: SoakConfig) -> list[Plan]:
    """The requests, drawn from a seeded generator: the same soak every run."""
    rng = random.Random(config.seed)
    prompts = PROMPTS[: config.prompts]
    plans = []
    for index in range(config.requests):
        kind = rng.choice(["plain", "fixed", "adaptive", "sampled", "top_k", "top_p", "penalty", "stop"])
        options: dict[str, object] = {}
        if kind == "plain":
            options["speculative"] = False
        elif kind == "fixed":
            options["num_speculative_tokens"] = rng.choice([1, 2, 4])
        elif kind == "adaptive":
            options["adaptive"] = True
        else:
            options.update(temperature=0.8, seed=rng.randrange(2**31))
            if kind == "top_k":
                options["top_k"] = 20
            elif kind == "top_p":
                options["top_p"] = 0.9
            elif kind == "penalty":
                options["repetition_penalty"] = 1.1
            elif kind == "stop":
                options["stop"] = ["\n\n"]
        cancel_after = rng.randint(1, 6) if rng.random() < config.cancel_fraction else None
        plans.append(Plan(index, rng.choice(prompts), rng.choice(LENGTHS), options,
                          greedy=kind in ("plain", "fixed", "adaptive"), cancel_after=cancel_after))
    return plans


class RssSampler:
    """Resident memory of the stack's processes, sampled every `interval_s` on a thread."""

    def __init__(self, processes: Callable[[], dict[str, int]], interval_s: float = 0.5) -> None:
        self.processes = processes
        self.interval_s = interval_s
        self.samples: dict[str, list[float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def sample(self) -> None:
        for name, pid in self.processes().items():
            mb = rss_mb(pid)
            if mb is not None:
                self.samples.setdefault(name, []).append(mb)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> dict[str, dict[str, float]]:
        self._stop.set()
        self._thread.join()
        self.sample()
        return {name: {"start": v[0], "peak": max(v), "end": v[-1]} for name, v in self.samples.items() if v}


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def kv_state(address: str, stub_cls: Callable[[grpc.Channel], object]) -> tuple[int, int, int]:
    """(free KV tokens, total KV tokens, active slots) from a model service's Info."""
    with grpc.insecure_channel(address) as channel:
        info = stub_cls(channel).Info(common_pb2.InfoRequest(), timeout=10)  # type: ignore[attr-defined]
    return int(info.free_kv_tokens), int(info.total_kv_tokens), int(info.active_slots)


def _services(stack: Stack) -> dict[str, tuple[str, Callable[[grpc.Channel], object]]]:
    return {
        "target": (stack.target.address, target_pb2_grpc.TargetServiceStub),
        "draft": (stack.draft.address, draft_pb2_grpc.DraftServiceStub),
    }


def _wait_idle(stack: Stack, timeout_s: float = 60.0) -> dict[str, tuple[int, int, int]]:
    """Each service's KV state once no slot is held (or the last state seen at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = {name: kv_state(address, stub) for name, (address, stub) in _services(stack).items()}
        if all(free == total and slots == 0 for free, total, slots in states.values()) or time.monotonic() > deadline:
            return states
        time.sleep(0.5)


def greedy_references(client: SpecdecClient, prompts: Sequence[str]) -> dict[str, list[int]]:
    """Each prompt's solo plain greedy output, at the longest length the soak asks for."""
    return {prompt: client.generate(chat(prompt), max_new_tokens=max(LENGTHS), speculative=False).token_ids
            for prompt in prompts}


def run_one(client: SpecdecClient, plan: Plan) -> tuple[str, list[int], float]:
    """Send one request; returns (outcome, tokens, seconds). Outcome: "ok", "cancelled" or a status name."""
    started = time.perf_counter()
    call = client.stub.Generate(
        build_request(chat(plan.prompt), max_new_tokens=plan.max_new_tokens, **plan.options),  # type: ignore[arg-type]
        timeout=300, metadata=client.metadata,
    )
    tokens: list[int] = []
    try:
        messages = 0
        for response in call:
            tokens.extend(response.token_ids)
            messages += 1
            if plan.cancel_after is not None and messages >= plan.cancel_after and not response.HasField("completion"):
                call.cancel()
                return "cancelled", tokens, time.perf_counter() - started
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.CANCELLED and plan.cancel_after is not None:
            return "cancelled", tokens, time.perf_counter() - started
        return error.code().name, tokens, time.perf_counter() - started
    return "ok", tokens, time.perf_counter() - started


class DraftFaults:
    """Kill the draft (then restart it on the same port) and stop it for a while, once each."""

    def __init__(self, stack: Stack, draft_args: Sequence[str], report: SoakReport, stop_seconds: float) -> None:
        self.stack = stack
        self.draft_args = list(draft_args)
        self.report = report
        self.stop_seconds = stop_seconds
        self._threads: list[threading.Thread] = []
        #: Drafts started here (`running_stack` stops only the first one).
        self.restarted: list[ServiceProcess] = []

    def kill_and_restart(self) -> None:
        port = int(self.stack.draft.address.rsplit(":", 1)[1])
        old = self.stack.draft
        old.process.kill()
        old.process.wait()
        self.report.events.append(f"draft SIGKILL at {time.strftime('%H:%M:%S')}")

        def restart() -> None:
            started = time.monotonic()
            new = start_service("specdec.draft_server", [*QUIET, *self.draft_args], port=port)
            self.restarted.append(new)
            self.stack.draft = new.wait_ready()
            self.report.events.append(f"draft back on :{port} after {time.monotonic() - started:.1f} s")

        self._threads.append(threading.Thread(target=restart, name="draft-restart"))
        self._threads[-1].start()

    def stop_for_a_while(self) -> None:
        for thread in self._threads:  # the restarted draft must be up to be stopped
            thread.join()
        pid = self.stack.draft.process.pid
        os.kill(pid, signal.SIGSTOP)
        self.report.events.append(f"draft SIGSTOP for {self.stop_seconds:.0f} s")
        timer = threading.Timer(self.stop_seconds, os.kill, (pid, signal.SIGCONT))
        timer.start()
        self._threads.append(timer)

    def join(self) -> None:
        for thread in self._threads:
            thread.join()

    def stop_restarted(self) -> None:
        for process in self.restarted:
            process.stop()


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _load(
    stack: Stack, config: SoakConfig, plans: list[Plan], faults: DraftFaults, report: SoakReport, progress: bool
) -> tuple[dict[str, tuple[int, int, int]], Counter[str], list[float]]:
    """References, then the load with the faults; returns the services' final KV states,
    the outcome counts and the latencies of the completed requests."""
    watched: dict[str, ServiceProcess] = {}

    def processes() -> dict[str, int]:
        watched.update(target=stack.target, draft=stack.draft, gateway=stack.gateway)
        return {name: proc.process.pid for name, proc in watched.items() if proc.process.poll() is None}

    with SpecdecClient(stack.address, timeout=300) as client:
        references = greedy_references(client, sorted({plan.prompt for plan in plans if plan.greedy}))
        for name, (free, total, _) in _wait_idle(stack).items():
            report.kv_before[name] = (free, total)
        sampler = RssSampler(processes).start()
        sampler.sample()
        kill_at, stop_at = int(config.kill_draft_at * len(plans)), int(config.stop_draft_at * len(plans))
        outcomes: Counter[str] = Counter()
        latencies: list[float] = []
        started = time.perf_counter()
        lock = threading.Lock()
        bar = tqdm(total=len(plans), desc="soak", disable=not progress, file=sys.stderr)

        def send(plan: Plan) -> None:
            if plan.index == kill_at:
                faults.kill_and_restart()
            if plan.index == stop_at:
                faults.stop_for_a_while()
            outcome, tokens, seconds = run_one(client, plan)
            with lock:
                outcomes[outcome] += 1
                report.completion_tokens += len(tokens)
                if outcome == "ok":
                    latencies.append(seconds)
                    if plan.greedy:
                        _check_greedy(report, plan, tokens, references[plan.prompt])
                bar.update(1)

        with ThreadPoolExecutor(config.concurrency) as pool:
            list(pool.map(send, plans))
        bar.close()
        faults.join()
        report.wall_s = time.perf_counter() - started
    states = _wait_idle(stack)
    report.rss_mb = sampler.stop()
    return states, outcomes, latencies


def _check_greedy(report: SoakReport, plan: Plan, tokens: list[int], reference: list[int]) -> None:
    """A greedy output must be its solo run, cut at the requested length (or at EOS)."""
    report.greedy_checked += 1
    expected = reference[: plan.max_new_tokens]
    if tokens != expected:
        report.greedy_mismatches += 1
        first = common_prefix_length(tokens, expected)
        report.failures.append(f"request {plan.index}: greedy output differs from its solo run at token {first}")


def run_soak(config: SoakConfig, *, progress: bool = True) -> SoakReport:
    report = SoakReport(config, cpu_model())
    plans = make_plans(config)
    draft_args = config.service_args.split()
    with running_stack(config.service_args, config.service_args, config.gateway_args) as stack:
        faults = DraftFaults(stack, draft_args, report, config.stop_seconds)
        try:
            states, outcomes, latencies = _load(stack, config, plans, faults, report, progress)
        finally:
            faults.join()  # a stopped draft gets its SIGCONT before anything stops
            faults.stop_restarted()
    report.requests = len(plans)
    report.completed = outcomes.pop("ok", 0)
    report.cancelled = outcomes.pop("cancelled", 0)
    report.errors = dict(outcomes)
    report.latency_p50_s, report.latency_p95_s = _percentile(latencies, 0.5), _percentile(latencies, 0.95)
    for name, (free, total, slots) in states.items():
        report.kv_after[name] = (free, total)
        report.slots_after[name] = slots
    _judge(report)
    return report


def _judge(report: SoakReport) -> None:
    if report.errors:
        report.failures.append(f"unexpected errors: {report.errors}")
    for name, (free, total) in report.kv_after.items():
        if free != total or report.slots_after[name]:
            report.failures.append(f"{name}: {total - free} KV tokens and {report.slots_after[name]} slots still held")
        if report.kv_before.get(name) != (free, total):
            report.failures.append(f"{name}: free KV {free} after the run, {report.kv_before.get(name)} before")
    for name, rss in report.rss_mb.items():
        if name != "draft" and rss["end"] - rss["start"] > report.config.max_rss_growth_mb:  # the draft restarted
            report.failures.append(f"{name} grew from {rss['start']:.0f} to {rss['end']:.0f} MB")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec_bench.soak", description=__doc__.split("\n\n")[0])
    defaults = SoakConfig()
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--cancel-fraction", type=float, default=defaults.cancel_fraction)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--stop-seconds", type=float, default=defaults.stop_seconds)
    parser.add_argument("--max-rss-growth-mb", type=float, default=defaults.max_rss_growth_mb)
    parser.add_argument("--json", default="", help="also write the report to this JSON file")
    args = parser.parse_args(argv)
    config = SoakConfig(
        requests=args.requests, concurrency=args.concurrency, cancel_fraction=args.cancel_fraction, seed=args.seed,
        stop_seconds=args.stop_seconds, max_rss_growth_mb=args.max_rss_growth_mb,
    )
    report = run_soak(config)
    print(report.summary())
    if args.json:
        with open(args.json, "w") as out:
            json.dump({**asdict(report), "ok": report.ok}, out, indent=2)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
