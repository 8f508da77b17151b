"""The check's stages that run the three services: greedy parity and the speed through the stack.

The services start as in production, three processes on loopback, through the benchmark's own
launcher (`specdec_bench.stack.running_stack`), with compiled steps off (start-up then costs the
same every run; the `service_defaults` stage tries the defaults), no prefix caching (every
repeat of a prompt is computed) and, where a stage measures no speed, no start-up timing.
Prompts go as plain text: the random models' tokenizer has no chat template.
"""

from __future__ import annotations

import math
import shlex
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from specdec.client import SpecdecClient
from specdec.v1 import common_pb2
from specdec_bench.analysis import phase_seconds, summarize
from specdec_bench.gpu.config import GpuCheckConfig
from specdec_bench.gpu.record import Record
from specdec_bench.peers import run_peers
from specdec_bench.results import BenchResults, ServiceCosts
from specdec_bench.stack import Stack, running_stack
from specdec_bench.step_timing import probe_steps
from specdec_bench.sweeps import counted_request, run_group, warm_up
from specdec_bench.workloads import PROMPTS, RunRecord, run_request

#: Deadline of one request: the stage's time box is the real limit.
REQUEST_TIMEOUT_S = 300.0


@contextmanager
def check_stack(
    config: GpuCheckConfig, record: Record, target: str, draft: str, dtype: str, *, measure_costs: bool,
    extra: tuple[str, str] = ("", ""),
) -> Iterator[tuple[Stack, SpecdecClient]]:
    """Target, draft and gateway on the check's device, both models unquantized in `dtype`, the
    target and the gateway with the `extra` flags (target's, gateway's); and a client. Without
    `measure_costs` the model services skip their start-up timing (a stage that measures no
    speed needs none). Records how long the services took to start, serve and stop."""
    costs = "" if measure_costs else " --no-measure-costs"

    def model_flags(model: str) -> str:
        return (f"--model {shlex.quote(model)} --device {config.device} --dtype {dtype} --quantization none "
                f"--compile off --no-prefix-caching{costs}")

    gateway = f"--max-batch-size {max(config.concurrency)} {extra[1]}".strip()
    started = time.monotonic()
    with running_stack(f"{model_flags(target)} {extra[0]}".strip(), model_flags(draft), gateway) as stack:
        ready = time.monotonic()
        record.put("start_s", {"target": stack.target.ready_s, "draft": stack.draft.ready_s,
                               "gateway": stack.gateway.ready_s, "all": ready - started})
        with SpecdecClient(stack.address, timeout=REQUEST_TIMEOUT_S) as client:
            yield stack, client
        stopping = time.monotonic()
        record.put("serve_s", stopping - ready)
    record.put("stop_s", time.monotonic() - stopping)


def model_summary(info: common_pb2.ModelInfo) -> dict[str, str]:
    """What a model service says it runs."""
    return {"model": info.model_name, "dtype": info.dtype, "quantization": info.quantization or "none",
            "device": info.device}


def services_of(client: SpecdecClient) -> dict[str, dict[str, str]]:
    """What the gateway says its two services run."""
    info = client.info()
    return {"target": model_summary(info.target), "draft": model_summary(info.draft)}


@dataclass
class GreedyComparison:
    """Greedy speculative against plain output of the same prompts, position by position
    (a position one output lacks counts as differing)."""

    k: int
    prompts: int = 0
    tokens: int = 0
    mismatched_tokens: int = 0
    diverged_prompts: int = 0
    #: Per prompt, the first position where the outputs differ (None: identical).
    first_divergence: list[int | None] = field(default_factory=list)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    #: Seconds the plain and the speculative requests took, all together.
    plain_s: float = 0.0
    speculative_s: float = 0.0

    def add(
        self, plain: list[int], speculative: list[int], draft_tokens: int, accepted_tokens: int,
        seconds: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        """One prompt's outputs, its speculative request's counters and (plain, speculative) seconds."""
        self.plain_s += seconds[0]
        self.speculative_s += seconds[1]
        width = max(len(plain), len(speculative))
        differ = [i for i in range(width) if i >= len(plain) or i >= len(speculative) or plain[i] != speculative[i]]
        self.prompts += 1
        self.tokens += width
        self.mismatched_tokens += len(differ)
        self.diverged_prompts += bool(differ)
        self.first_divergence.append(differ[0] if differ else None)
        self.draft_tokens += draft_tokens
        self.accepted_tokens += accepted_tokens

    @property
    def mismatch_rate(self) -> float:
        return self.mismatched_tokens / self.tokens if self.tokens else float("nan")

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else float("nan")

    def first_mismatch(self) -> int | None:
        return min((i for i in self.first_divergence if i is not None), default=None)

    def as_dict(self) -> dict[str, object]:
        return {**vars(self), "mismatch_rate": self.mismatch_rate, "acceptance_rate": self.acceptance_rate}


def service_pairs(
    config: GpuCheckConfig, record: Record, dtype: str, *, prompts: int, max_new_tokens: int, sampled: bool,
    extra: tuple[str, str] = ("", ""),
) -> GreedyComparison:
    """Each prompt greedy, plain and then speculative at a fixed K, through the target and draft
    of the config in `dtype` (`extra` flags as `check_stack` takes them); with `sampled`, one
    sampled speculative request must complete too."""
    k = config.parity_k
    comparison = GreedyComparison(k)
    with check_stack(config, record, config.target_model, config.draft_model, dtype, measure_costs=False,
                     extra=extra) as (_, client):
        record.put("services", services_of(client))
        warm_up(client, k)
        for prompt in range(prompts):
            plain_run, plain = run_request(client, "parity", prompt, 0, max_new_tokens=max_new_tokens)
            spec_run, spec = run_request(client, "parity", prompt, k, max_new_tokens=max_new_tokens)
            comparison.add(plain.token_ids, spec.token_ids, spec.num_draft_tokens, spec.num_accepted_tokens,
                           (plain_run.total_s, spec_run.total_s))
            record.put("greedy", comparison.as_dict())
        if sampled:
            _, result = run_request(client, "sampled", 0, None, max_new_tokens=max_new_tokens, temperature=0.8,
                                    seed=1)
            record.put("sampled", {"finish_reason": result.finish_reason, "tokens": result.completion_tokens,
                                   "acceptance_rate": result.acceptance_rate})
    return comparison


class _PhaseLog:
    """A progress bar for the stage's log: it names each phase and counts nothing."""

    def update(self, n: float | None = 1) -> bool | None:
        return None

    def set_description(self, desc: str | None = None, refresh: bool | None = True) -> None:
        print(desc, flush=True)  # into the stage's log


def capture_pass(client: SpecdecClient, config: GpuCheckConfig) -> None:
    """Every request the timed runs send, once, untimed. A service captures a step's CUDA graph
    the first time a step of its shape (requests, tokens, key blocks) comes; greedy requests
    repeat their steps exactly, so after this pass the timed ones replay graphs only, as a
    server does once it has run a while."""
    for prompt in range(config.speed_prompts):
        for k in (0, *config.speed_ks):
            run_request(client, "capture", prompt, k, max_new_tokens=config.speed_tokens)
    for level in config.concurrency:
        for k in (0, config.concurrency_k):
            run_group(client, level, k, max_new_tokens=config.concurrency_tokens, prompts=PROMPTS, phase="capture")


def _fixed_k_runs(
    client: SpecdecClient, stack: Stack, config: GpuCheckConfig
) -> tuple[list[RunRecord], dict[int, list[int]], GreedyComparison]:
    """Every speed prompt plain and at each fixed K (order alternating by prompt), with the
    gateway's acceptance counters: the fixed-K sweep of the benchmark."""
    records: list[RunRecord] = []
    plain_tokens: dict[int, list[int]] = {}
    comparison = GreedyComparison(max(config.speed_ks))
    ks = [0, *config.speed_ks]
    for prompt in range(config.speed_prompts):
        outputs: dict[int, list[int]] = {}
        for k in ks if prompt % 2 == 0 else reversed(ks):
            record, result = counted_request(client, stack, "fixed_k", prompt, k, max_new_tokens=config.speed_tokens)
            records.append(record)
            outputs[k] = result.token_ids
        plain_tokens[prompt] = outputs[0]
        comparison.add(outputs[0], outputs[comparison.k], 0, 0)
    return records, plain_tokens, comparison


def stack_speed(config: GpuCheckConfig, record: Record) -> None:
    """The target drafting for itself (acceptance near 1, and measured): plain decode through
    the stack against transformers' `generate` on the same weights; each fixed K's measured
    speedup against Theorem 3.8 with the measured α, c and s (the benchmark's analysis); then
    aggregate tokens/s at each concurrency, plain and speculative."""
    with check_stack(config, record, config.target_model, config.target_model, config.dtype,
                     measure_costs=True) as (stack, client):
        record.put("services", services_of(client))
        costs = ServiceCosts.from_info(client.info())
        warm_up(client, max(config.speed_ks))
        capture_pass(client, config)
        sweep, plain_tokens, comparison = _fixed_k_runs(client, stack, config)
        record.put("greedy_vs_plain", comparison.as_dict())
        record.put("fixed_k_runs", [{"prompt": r.prompt, "k": r.k, "tokens_per_s": r.tokens_per_s} for r in sweep])
        record.put("round_ms_per_token", round_ms_per_token(sweep))
        vocab = client.info().target.vocab_size
        pairs = probe_steps(stack.target.address, stack.draft.address, vocab, pairs=config.step_pairs)
        record.put("concurrency", _concurrency(client, config))
        peers = run_peers(
            stack.target_config, stack.draft_config, prompts=config.speed_prompts, max_new_tokens=config.speed_tokens,
            k=0, repetitions=1, reference=plain_tokens, progress=_PhaseLog(), methods=("hf_plain",),
        )
        record.put("transformers_runs", peers)
    # The analysis last: the measurements above are recorded whatever it makes of them.
    summary = summarize(BenchResults(meta={}, costs=costs, w1=[r for r in sweep if r.k == 0], peers=peers,
                                     k_sweep=sweep, step_pairs=pairs))
    record.put("plain_decode", {
        "stack_tokens_per_s": summary.greedy.plain.median, "transformers_tokens_per_s": summary.hf_plain.median,
        "stack_over_transformers": summary.vs_hf_plain, "transformers_matches_ours": summary.hf_matches_ours,
    })
    costs_used = summary.headline_costs
    record.put("efficiency", {
        "alpha": summary.alpha, "alpha_source": summary.alpha_source, "c": costs_used.c,
        "c_source": costs_used.source, "s_by_k": costs_used.s_by_k,
        "by_k": [row for row in summary.k_rows if row.k > 0],
    })


def round_ms_per_token(runs: list[RunRecord]) -> dict[str, dict[str, float]]:
    """Per fixed K ("K=0" plain), milliseconds per generated token in each round phase
    (`specdec_bench.analysis.PHASES`: both services' compute, the RPCs around it, acceptance, the rest)."""
    table = {}
    for k in sorted({r.k for r in runs if r.k is not None}):
        of_k = [r for r in runs if r.k == k]
        tokens = sum(r.completion_tokens for r in of_k)
        table[f"K={k}"] = {phase: 1e3 * seconds / tokens if tokens else math.nan
                           for phase, seconds in phase_seconds(of_k).items()}
    return table


@dataclass
class ConcurrencyFigures:
    """Aggregate tokens/s of `concurrency` requests at once, plain and at a fixed K."""

    concurrency: int
    k: int
    plain_tokens_per_s: float
    speculative_tokens_per_s: float

    @property
    def speedup(self) -> float:
        return self.speculative_tokens_per_s / self.plain_tokens_per_s


def _concurrency(client: SpecdecClient, config: GpuCheckConfig) -> list[dict[str, object]]:
    rows = []
    k = config.concurrency_k
    for turn, level in enumerate(config.concurrency):
        rates: dict[int, float] = {}
        for mode in (0, k) if turn % 2 == 0 else (k, 0):
            group = run_group(client, level, mode, max_new_tokens=config.concurrency_tokens, prompts=PROMPTS)
            rates[mode] = group.tokens_per_s
        figures = ConcurrencyFigures(level, k, rates[0], rates[k])
        rows.append({**vars(figures), "speedup": figures.speedup})
    return rows
