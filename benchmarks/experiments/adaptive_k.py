"""Adaptive K on a mixed workload: is it as fast as the best fixed K, and never slower than plain?

    .venv/bin/python benchmarks/experiments/adaptive_k.py [--tokens 96] [--ks 1,2,4,8] [--concurrency 1,2,4,8,16]

Three parts, each on its own freshly started trio (target, draft, gateway):

* `default draft`: the default int4 self-draft on the chat prompts of `specdec bench`;
* `2-layer draft`: a draft of the target's first two layers (`--num-layers 2`), which is
  cheap and mostly rejected, on the same prompts;
* `repetitive`: the default draft on prompts whose answers repeat themselves (counting,
  lists), with twice as many new tokens: long, highly predictable outputs.

In each part single greedy requests run plain, with the gateway's adaptive K and with
every fixed K of `--ks`, interleaved per prompt, `--single-reps` times over the prompts;
adaptive K is compared with each mode by the median of its ratios on the same prompt and
repetition (pairwise: a ratio of two requests that ran a few seconds apart, where the
machine's speed drifts by ±20 % over minutes). Then, at every concurrency level, groups
of requests run plain, adaptive and with the part's best fixed K, `--concurrency-reps`
groups per mode in alternating order; the table gives each mode's median and, per level,
the median over repetitions of adaptive ÷ the better of the other two in the same
repetition (groups that ran back to back: one group's rate moves by ±10 % from the next
on a shared VM, so the worst of five levels' medians reads low even between identical
modes). Greedy outputs are
checked against plain decoding. The gateway's upper bound for adaptive K is the largest
of `--ks`, so adaptive K may pick anything a fixed K was allowed.

It prints one table per part and writes the figures to `--results` (JSON) and a Markdown
page (`--docs`), both relative to the repository root.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from specdec.client import SpecdecClient
from specdec_bench.results import machine
from specdec_bench.runner import REQUEST_TIMEOUT_S, resolve
from specdec_bench.stack import running_stack
from specdec_bench.sweeps import check_exact, run_group
from specdec_bench.workloads import PROMPTS, RunRecord, mode_name, run_request

REPETITIVE_PROMPTS: tuple[str, ...] = (
    "Count from 1 to 200, writing each number as a word, separated by commas.",
    "Write the English alphabet from A to Z, one letter per line, five times over.",
    "List the days of the week, one per line, and repeat the whole list ten times.",
)


@dataclass(frozen=True)
class Part:
    name: str
    draft_args: str
    prompts: tuple[str, ...]
    tokens_factor: int


PARTS = (
    Part("default draft", "", PROMPTS[:3], 1),
    Part("2-layer draft", "--num-layers 2", PROMPTS[:3], 1),
    Part("repetitive", "", REPETITIVE_PROMPTS, 2),
)


@dataclass
class PartResult:
    name: str
    #: Median single-request tokens/s per mode (`plain`, `speculative` = adaptive, `K=<k>`).
    single: dict[str, float] = field(default_factory=dict)
    #: Per other mode: the median over prompts and repetitions of adaptive ÷ that mode.
    adaptive_ratio: dict[str, float] = field(default_factory=dict)
    #: Mean K the adaptive runs chose, and their acceptance rate.
    adaptive_mean_k: float = 0.0
    adaptive_acceptance: float = 0.0
    best_k: int = 0
    #: Aggregate tokens/s per concurrency level and mode (`plain`, `speculative`, `K=<best>`).
    concurrent: dict[int, dict[str, float]] = field(default_factory=dict)
    #: Per concurrency level and mode, every group's tokens/s in repetition order.
    concurrent_groups: dict[int, dict[str, list[float]]] = field(default_factory=dict)
    #: Per concurrency level: the median over repetitions of adaptive ÷ the better of plain
    #: and the best fixed K in the same repetition (groups run back to back).
    concurrent_ratio: dict[int, float] = field(default_factory=dict)


def run_part(part: Part, args: argparse.Namespace, progress: tqdm) -> PartResult:
    tokens = args.tokens * part.tokens_factor
    ks: list[int | None] = [0, None, *args.ks]
    result = PartResult(part.name)
    gateway_args = f"--num-speculative-tokens {max(args.ks)}"
    cold = "--no-prefix-caching"  # every prompt is sent once per mode: each computed in full
    with running_stack(cold, f"{cold} {part.draft_args}", gateway_args) as stack:
        with SpecdecClient(stack.address, timeout=REQUEST_TIMEOUT_S) as client:
            for k in (0, None, max(args.ks)):  # warm-up: allocators and kernels
                run_request(client, "warm-up", 0, k, max_new_tokens=8)
            rates: dict[str, list[float]] = {mode_name(k): [] for k in ks}  # in (repetition, prompt) order
            adaptive: list[RunRecord] = []
            progress.set_description(f"{part.name}: single requests")
            for rep in range(args.single_reps):
                for prompt in range(len(part.prompts)):
                    order = ks if (rep + prompt) % 2 == 0 else list(reversed(ks))
                    outputs: dict[str, list[int]] = {}
                    for k in order:
                        record, out = run_request(client, "adaptive_k", prompt, k, max_new_tokens=tokens,
                                                  prompts=part.prompts)
                        rates[record.mode].append(record.tokens_per_s)
                        outputs[record.mode] = out.token_ids
                        if k is None:
                            adaptive.append(record)
                        progress.update()
                    for mode, ids in outputs.items():
                        check_exact(prompt, mode, ids, outputs["plain"])
            result.single = {mode: statistics.median(values) for mode, values in rates.items()}
            result.adaptive_ratio = {
                mode: statistics.median(a / b for a, b in zip(rates["speculative"], values))
                for mode, values in rates.items() if mode != "speculative"
            }
            rounds = sum(r.num_rounds for r in adaptive)
            drafted = sum(r.num_draft_tokens for r in adaptive)
            result.adaptive_mean_k = drafted / rounds if rounds else 0.0
            result.adaptive_acceptance = sum(r.num_accepted_tokens for r in adaptive) / drafted if drafted else 0.0
            result.best_k = max(args.ks, key=lambda k: result.single[mode_name(k)])
            modes: list[int | None] = [0, None, result.best_k]
            for level in args.concurrency:
                progress.set_description(f"{part.name}: concurrency {level}")
                groups: dict[str, list[float]] = {mode_name(k): [] for k in modes}
                for rep in range(args.concurrency_reps):  # alternating order: a slow minute lands on every mode
                    for k in modes if rep % 2 == 0 else list(reversed(modes)):
                        group = run_group(client, level, k, max_new_tokens=tokens, prompts=part.prompts,
                                          phase="adaptive_k")
                        groups[mode_name(k)].append(group.tokens_per_s)
                        progress.update()
                result.concurrent[level] = {mode: statistics.median(rates) for mode, rates in groups.items()}
                result.concurrent_groups[level] = groups
                best = mode_name(result.best_k)
                result.concurrent_ratio[level] = statistics.median(
                    a / max(p, b) for a, p, b in zip(groups["speculative"], groups["plain"], groups[best])
                )
    return result


def verdicts(r: PartResult) -> list[str]:
    """The issue's three checks on one part, as text."""
    lines = [
        f"adaptive ÷ best fixed K (K={r.best_k}), pairwise median: {r.adaptive_ratio[mode_name(r.best_k)]:.2f}x",
        f"adaptive ÷ plain, pairwise median: {r.adaptive_ratio['plain']:.2f}x",
    ]
    worst = min(row["speculative"] / max(row["plain"], row[mode_name(r.best_k)]) for row in r.concurrent.values())
    lines.append(f"concurrency, adaptive ÷ better of plain and K={r.best_k}, worst level: {worst:.2f}x "
                 f"of the medians, {min(r.concurrent_ratio.values()):.2f}x pairwise (median over repetitions)")
    return lines


def table(r: PartResult, ks: list[int]) -> str:
    modes = ["plain", "speculative", *(mode_name(k) for k in ks)]
    head = "| single request, tok/s | " + " | ".join("adaptive" if m == "speculative" else m for m in modes) + " |"
    rows = [head, "|" + "---|" * (len(modes) + 1),
            "| median | " + " | ".join(f"{r.single[m]:.1f}" for m in modes) + " |",
            "| adaptive ÷ this mode, pairwise median | "
            + " | ".join("1.00" if m == "speculative" else f"{r.adaptive_ratio[m]:.2f}" for m in modes) + " |"]
    conc_modes = ["plain", "speculative", mode_name(r.best_k)]
    rows += ["", "| concurrency, aggregate tok/s (median; groups' range) | plain | adaptive | " + mode_name(r.best_k)
             + " | adaptive ÷ better, pairwise median |", "|---|---|---|---|---|"]
    for level, row in r.concurrent.items():
        groups = r.concurrent_groups[level]
        cells = [f"{row[m]:.1f} ({min(groups[m]):.0f}-{max(groups[m]):.0f})" for m in conc_modes]
        rows.append(f"| {level} | " + " | ".join(cells) + f" | {r.concurrent_ratio[level]:.2f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=96,
                        help="new tokens per request (twice that for the repetitive part)")
    parser.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8],
                        help="fixed Ks to compare")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16])
    parser.add_argument("--concurrency-reps", type=int, default=3,
                        help="groups per mode and concurrency level, in alternating order")
    parser.add_argument("--single-reps", type=int, default=2, help="single requests per prompt and mode")
    parser.add_argument("--results", default="benchmarks/results/adaptive_k.json")
    parser.add_argument("--docs", default="docs/adaptive_k.md")
    args = parser.parse_args()
    started = time.monotonic()
    runs_per_part = 3 * (2 + len(args.ks)) * args.single_reps + 3 * len(args.concurrency) * args.concurrency_reps
    results = []
    with tqdm(total=runs_per_part * len(PARTS), unit="run", file=sys.stderr, dynamic_ncols=True) as progress:
        for part in PARTS:
            results.append(run_part(part, args, progress))
    facts = machine()
    vector = " ".join(f for f in facts["cpu_flags"].split() if f.startswith(("avx", "amx")))
    cpu = f"{facts['cpu_model']}, {facts['cpus']} cores ({vector or 'no AVX'})"
    command = "python " + " ".join(sys.argv)
    lines = [
        "# Adaptive K on a mixed workload",
        "",
        f"Measured by `{command}` on {cpu} ({time.monotonic() - started:.0f} s, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}). What each part runs is in the script's docstring.",
    ]
    for r in results:
        lines += ["", f"## {r.name}", "",
                  f"Adaptive K, single requests: mean K {r.adaptive_mean_k:.2f} over the rounds that drafted, "
                  f"acceptance {r.adaptive_acceptance:.2f}.", "",
                  table(r, args.ks), "", *(f"* {v}" for v in verdicts(r))]
    page = "\n".join(lines) + "\n"
    print(page)
    resolve(args.results).write_text(json.dumps({"command": command, "machine": facts,
                                                  "parts": [r.__dict__ for r in results]}, indent=1))
    if args.docs:
        resolve(args.docs).write_text(page)


if __name__ == "__main__":
    main()
