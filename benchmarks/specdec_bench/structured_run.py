"""Measure the structured workload (`specdec_bench.structured` has the records and figures).

Runs on the stack the rest of the run measured, with a second gateway on the same target and
draft started with `--no-grammar-drafts --decode-steps 1` for the scenario only (idle while the
first serves, stopped at its end): it serves the speculative requests without grammar drafts
and the unconstrained plain ones, one token a target call as a grammar's plain rounds take.
Each repetition runs every prompt alone in every mode, then one group of `GROUP_SIZE` prompts
at once per mode; the modes' order rotates from slot to slot.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone

from specdec.client import SpecdecClient
from specdec_bench.config import BenchConfig
from specdec_bench.stack import Stack, scrape_metrics, second_gateway
from specdec_bench.structured import (
    CONSTRAINED,
    GROUP_SIZE,
    StructuredGroup,
    StructuredMode,
    StructuredRecord,
    StructuredRun,
    identical_outputs,
)
from specdec_bench.structured_workload import STRUCTURED_PROMPTS, SchemaKind, answer_problem, prompt_texts
from specdec_bench.sweeps import Progress, method_order
from specdec_bench.workloads import REQUEST_TIMEOUT_S, run_request

#: The second gateway's flags: forced tokens are not drafted, and plain rounds decode one token
#: a call, as a constrained request's do (the mask covers one step), so that unconstrained ÷
#: constrained plain is the grammar's cost alone.
SECOND_GATEWAY = ("--no-grammar-drafts", "--decode-steps", "1")
SECOND_MODES = (StructuredMode.NO_GRAMMAR_DRAFTS, StructuredMode.FREE_PLAIN)
#: New tokens of a warm-up request.
WARM_UP_TOKENS = 8


@dataclass(frozen=True)
class Gateway:
    client: SpecdecClient
    metrics_port: int


@dataclass(frozen=True)
class Plan:
    """Where each mode's requests go, and each prompt's unconstrained budget (`lengths`)."""

    gateways: dict[StructuredMode, Gateway]
    max_new_tokens: int
    #: Completion tokens of each prompt's constrained plain answer: the unconstrained requests' budget.
    lengths: dict[int, int]

    def budget(self, mode: StructuredMode, prompt: int) -> int:
        return self.max_new_tokens if mode.constrained else max(self.lengths.get(prompt, self.max_new_tokens), 2)


def digest(tokens: Sequence[int]) -> str:
    """A short fingerprint of a token sequence (outputs are compared, not stored)."""
    return hashlib.sha1(",".join(map(str, tokens)).encode()).hexdigest()[:16]


def structured_request(plan: Plan, mode: StructuredMode, prompt: int, *, repetition: int,
                       concurrency: int) -> StructuredRecord:
    """One greedy request of `mode` on `STRUCTURED_PROMPTS[prompt]`, its answer checked if constrained."""
    spec = STRUCTURED_PROMPTS[prompt]
    budget = plan.budget(mode, prompt)
    record, result = run_request(
        plan.gateways[mode].client, "structured", prompt, mode.k, max_new_tokens=budget, repetition=repetition,
        concurrency=concurrency, prompts=prompt_texts(), json_schema=spec.schema if mode.constrained else None,
    )
    problem = answer_problem(result.text, result.finish_reason, spec.schema) if mode.constrained else ""
    return StructuredRecord(mode.value, spec.kind.value, record, budget, result.finish_reason, problem,
                            digest(result.token_ids))


def forced_tokens(port: int) -> float:
    return scrape_metrics(port).forced_tokens


def run_structured_group(plan: Plan, mode: StructuredMode, prompts: Sequence[int], *, slot: int,
                         repetition: int) -> StructuredGroup:
    """`prompts` sent at once in `mode` (one prompt: a single request), the gateway's forced-token
    counter read around them."""
    port = plan.gateways[mode].metrics_port
    before = forced_tokens(port)
    with ThreadPoolExecutor(len(prompts)) as pool:
        started = time.perf_counter()
        futures = [pool.submit(structured_request, plan, mode, p, repetition=repetition, concurrency=len(prompts))
                   for p in prompts]
        records = [future.result() for future in futures]
        wall = time.perf_counter() - started
    return StructuredGroup(mode.value, len(prompts), slot, wall, records, round(forced_tokens(port) - before))


def warm_up_structured(gateways: dict[StructuredMode, Gateway], max_new_tokens: int) -> Plan:
    """Warm every mode up (each schema's first prompt, a few tokens); run every prompt once
    constrained plain, whose answer's length is the unconstrained requests' budget (greedy answers
    repeat), and once through the second gateway, whose planner has seen nothing of the run yet."""
    warm = Plan(gateways, WARM_UP_TOKENS, {})
    for kind in SchemaKind:
        prompt = next(i for i, p in enumerate(STRUCTURED_PROMPTS) if p.kind is kind)
        for mode in StructuredMode:
            structured_request(warm, mode, prompt, repetition=-1, concurrency=1)
    full = Plan(gateways, max_new_tokens, {})
    lengths = {}
    for prompt in range(len(STRUCTURED_PROMPTS)):
        lengths[prompt] = structured_request(full, StructuredMode.PLAIN, prompt, repetition=-1,
                                             concurrency=1).run.completion_tokens
        structured_request(full, StructuredMode.NO_GRAMMAR_DRAFTS, prompt, repetition=-1, concurrency=1)
    return Plan(gateways, max_new_tokens, lengths)


def structured_groups(plan: Plan, repetitions: int, progress: Progress) -> list[StructuredGroup]:
    """Per repetition: every prompt alone in every mode, then one group of `GROUP_SIZE` per mode."""
    groups: list[StructuredGroup] = []
    count, slot = len(STRUCTURED_PROMPTS), 0
    modes = tuple(StructuredMode)
    for rep in range(repetitions):
        batches = [[prompt] for prompt in range(count)] + [[(rep * GROUP_SIZE + i) % count for i in range(GROUP_SIZE)]]
        for prompts in batches:
            progress.set_description(f"structured, {len(prompts)} at once")
            for mode in method_order(modes, slot):
                groups.append(run_structured_group(plan, mode, prompts, slot=slot, repetition=rep))
                progress.update()
            slot += 1
    return groups


def measure_structured(client: SpecdecClient, stack: Stack, config: BenchConfig, progress: Progress) -> StructuredRun:
    """The scenario on `stack` (whose gateway `client` talks to) and a second gateway (`SECOND_GATEWAY`)."""
    progress.set_description(f"structured: starting a gateway with {' '.join(SECOND_GATEWAY)}")
    with second_gateway(stack, config.gateway_args, *SECOND_GATEWAY) as other, \
            SpecdecClient(other.address, timeout=REQUEST_TIMEOUT_S) as other_client:
        if other.ready is None or other.ready.metrics_port is None:
            raise RuntimeError(f"the second gateway's ready line names no metrics port: {other.ready}")
        main, second = Gateway(client, stack.metrics_port), Gateway(other_client, other.ready.metrics_port)
        gateways = {mode: second if mode in SECOND_MODES else main for mode in StructuredMode}
        progress.set_description("structured: warming up")
        plan = warm_up_structured(gateways, config.structured_tokens)
        groups = structured_groups(plan, config.structured_repetitions, progress)
    report_problems(groups)
    meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "repetitions": config.structured_repetitions, "max_new_tokens": config.structured_tokens,
            "prompts": len(STRUCTURED_PROMPTS), "group_size": GROUP_SIZE, "second_gateway": " ".join(SECOND_GATEWAY),
            "gateway_args": config.gateway_args, "lengths": plan.lengths}
    return StructuredRun(meta, groups)


def report_problems(groups: Sequence[StructuredGroup]) -> None:
    """Invalid answers and greedy mismatches, on stderr: counted and reported, not fatal (the
    figures stand, and the page shows them beside their targets)."""
    invalid = [r for g in groups if StructuredMode(g.mode).constrained for r in g.requests if r.problem]
    if invalid:
        print(f"*** structured workload: {len(invalid)} constrained answer(s) failed their schema, e.g. "
              f"{invalid[0].mode} prompt {invalid[0].run.prompt}: {invalid[0].problem} ***", file=sys.stderr)
    for level in sorted({g.concurrency for g in groups}):
        same, compared = identical_outputs(groups, level, CONSTRAINED)
        if same != compared:
            print(f"*** structured workload: at {level} request(s) at once, {compared - same} of {compared} "
                  "constrained greedy outputs differ between the constrained modes ***", file=sys.stderr)
