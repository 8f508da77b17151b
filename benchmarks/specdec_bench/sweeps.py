"""The measurements through the gateway: W1, the fixed-K sweep and the concurrency sweep.

Variants that are compared are interleaved (and their order alternated) so that machine
noise, which on a shared 2-core box drifts over minutes, hits them alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from specdec.client import GenerationResult, SpecdecClient
from specdec.prompt_lookup import common_prefix_length
from specdec_bench.config import BenchConfig
from specdec_bench.stack import Stack
from specdec_bench.workloads import PROMPTS, DraftMethod, RunRecord, Workload, mode_name, run_request

T = TypeVar("T")


class Progress(Protocol):
    """What the sweeps need of a progress bar (tqdm has it)."""

    def update(self, n: float | None = 1) -> bool | None: ...

    def set_description(self, desc: str | None = None, refresh: bool | None = True) -> None: ...


class ExactnessError(RuntimeError):
    """Greedy speculative output differs from plain output: the product's promise is broken."""


@dataclass
class W1Outcome:
    records: list[RunRecord]
    #: Greedy plain token ids per prompt: what the other variants must reproduce.
    greedy_tokens: dict[int, list[int]] = field(default_factory=dict)


@dataclass
class ConcurrencyGroup:
    """`concurrency` requests sent at once in one mode, and the wall time until all finished."""

    concurrency: int
    k: int | None
    wall_s: float
    requests: list[RunRecord]

    @property
    def mode(self) -> str:
        return mode_name(self.k)

    @property
    def tokens_per_s(self) -> float:
        """Aggregate throughput: all completion tokens over the group's wall time."""
        return sum(r.completion_tokens for r in self.requests) / self.wall_s


def check_exact(prompt: int, what: str, tokens: list[int], reference: list[int]) -> None:
    if tokens != reference:
        first = common_prefix_length(tokens, reference)
        raise ExactnessError(
            f"EXACTNESS BROKEN: greedy {what} output differs from plain decoding on prompt {prompt} "
            f"at token {first} ({len(tokens)} vs {len(reference)} tokens)"
        )


def warm_up(client: SpecdecClient, max_k: int) -> None:
    """One short request per mode, so first-call costs (allocators, kernels) stay out of the figures."""
    for k in (0, None, max(max_k, 1)):
        run_request(client, "warm-up", 0, k, max_new_tokens=8)


def modes(config: BenchConfig) -> tuple[int | None, ...]:
    """The Ks W1 and the concurrency sweep compare: plain (0), adaptive (None) and `config.fixed_k`."""
    return (0, None, *config.fixed_k)


def w1(
    client: SpecdecClient, config: BenchConfig, progress: Progress, between: Callable[[int], None] | None = None
) -> W1Outcome:
    """Single requests: every prompt greedy and sampled, plain, speculative (adaptive K) and at each
    fixed K side by side, the order rotating per prompt (`method_order`).
    `between(rep)` runs before each repetition, while the stack idles (the step-cost probes)."""
    outcome = W1Outcome(records=[])
    progress.set_description("W1 single request")
    for rep in range(config.repetitions):
        if between is not None:
            between(rep)
        for prompt in range(config.prompts):
            for temperature in (0.0, config.temperature):
                tokens: dict[int | None, list[int]] = {}
                for k in method_order(modes(config), rep + prompt):
                    record, result = run_request(
                        client, "w1", prompt, k, max_new_tokens=config.max_new_tokens, temperature=temperature,
                        seed=config.seed + prompt, repetition=rep,
                    )
                    outcome.records.append(record)
                    tokens[k] = result.token_ids
                    progress.update()
                if temperature == 0.0:
                    for k, output in tokens.items():
                        if k != 0:
                            check_exact(prompt, mode_name(k), output, tokens[0])
                    outcome.greedy_tokens.setdefault(prompt, tokens[0])
    return outcome


def counted_request(
    client: SpecdecClient, stack: Stack, phase: str, prompt: int, k: int, *, max_new_tokens: int
) -> tuple[RunRecord, GenerationResult]:
    """One greedy request at a fixed K (adaptive off; 0 = plain), alone on the stack: the
    gateway's counters are read around it, so its record carries its speculation rounds and
    its accepted tokens per draft position."""
    before = stack.metrics()
    record, result = run_request(client, phase, prompt, k, max_new_tokens=max_new_tokens)
    if k > 0:
        after = stack.metrics()
        record.num_drafts = round(after.num_drafts - before.num_drafts)
        record.accepted_per_pos = after.accepted_since(before, k)
    return record, result


def k_sweep(client: SpecdecClient, stack: Stack, config: BenchConfig, progress: Progress) -> list[RunRecord]:
    """Greedy single requests with a fixed K = 0..max_k (adaptive off), K order alternating per prompt
    (`counted_request`), each K's output checked against plain decoding's."""
    records: list[RunRecord] = []
    progress.set_description("fixed-K sweep")
    for prompt in range(config.sweep_prompts):
        ks = list(range(config.max_k + 1))
        tokens: dict[int, list[int]] = {}
        for k in ks if prompt % 2 == 0 else reversed(ks):
            record, result = counted_request(client, stack, "k_sweep", prompt, k, max_new_tokens=config.max_new_tokens)
            records.append(record)
            tokens[k] = result.token_ids
            progress.update()
        for k in ks[1:]:
            check_exact(prompt, f"K={k}", tokens[k], tokens[0])
    return records


def run_group(
    client: SpecdecClient, level: int, k: int | None, *, max_new_tokens: int, prompts: tuple[str, ...],
    phase: str = "concurrency"
) -> ConcurrencyGroup:
    """`level` greedy requests sent at once in mode `k`, cycling through `prompts`."""
    with ThreadPoolExecutor(level) as pool:
        started = time.perf_counter()
        futures = [
            pool.submit(run_request, client, phase, i % len(prompts), k, max_new_tokens=max_new_tokens,
                        repetition=i, concurrency=level, prompts=prompts)
            for i in range(level)
        ]
        records = [future.result()[0] for future in futures]
        wall = time.perf_counter() - started
    return ConcurrencyGroup(level, k, wall, records)


def concurrency_sweep(client: SpecdecClient, config: BenchConfig, progress: Progress) -> list[ConcurrencyGroup]:
    """`level` greedy requests at once (prompts cycled), plain, speculative (adaptive K) and each
    fixed K of `config.fixed_k` in turn.

    Each level runs `concurrency_repetitions` times per mode, back to back and in rotating
    order, so that a slow minute of a shared machine lands on every mode (the analysis
    reports medians)."""
    groups: list[ConcurrencyGroup] = []
    turn = 0
    for level in config.concurrency:
        progress.set_description(f"concurrency {level}")
        for _ in range(config.concurrency_repetitions):
            for k in method_order(modes(config), turn):
                groups.append(run_group(client, level, k, max_new_tokens=config.concurrency_tokens,
                                        prompts=PROMPTS[: config.prompts]))
                progress.update()
            turn += 1
    return groups


def warm_up_methods(client: SpecdecClient, lookup_client: SpecdecClient) -> None:
    """One short request per drafting method, on the gateway each is sent to."""
    prompts = Workload.COPY_HEAVY.prompts(0)
    for method in DraftMethod:
        run_request(lookup_client if method is DraftMethod.NGRAM else client, "warm-up", 0, method.k,
                    max_new_tokens=8, prompts=prompts, method=method)


def method_order(methods: tuple[T, ...], turn: int) -> tuple[T, ...]:
    """`methods` (or modes) rotated by `turn`: over consecutive prompts each takes each place in
    turn, so a slow stretch of a shared machine does not land on one of them."""
    shift = turn % len(methods)
    return methods[shift:] + methods[:shift]


def method_comparison(
    client: SpecdecClient, lookup_client: SpecdecClient, config: BenchConfig, progress: Progress
) -> list[RunRecord]:
    """Every workload's prompts alone and greedy, once per `DraftMethod` in rotating order
    (`method_order`), `workload_repetitions` times; lookups alone go to `lookup_client`, a gateway
    without a draft service. Every method's output is checked against plain decoding's."""
    records: list[RunRecord] = []
    methods = tuple(DraftMethod)
    turn = 0
    for rep in range(config.workload_repetitions):
        for workload in Workload:
            progress.set_description(f"methods: {workload.value}")
            prompts = workload.prompts(config.workload_chat_prompts)
            for prompt in range(len(prompts)):
                tokens: dict[DraftMethod, list[int]] = {}
                for method in method_order(methods, turn):
                    record, result = run_request(
                        lookup_client if method is DraftMethod.NGRAM else client, "methods", prompt, method.k,
                        max_new_tokens=config.workload_tokens, repetition=rep, prompts=prompts, method=method,
                    )
                    record.workload = workload.value
                    records.append(record)
                    tokens[method] = result.token_ids
                    progress.update()
                for method in methods[1:]:
                    check_exact(prompt, f"{workload.value} {method.value}", tokens[method], tokens[DraftMethod.PLAIN])
                turn += 1
    return records
