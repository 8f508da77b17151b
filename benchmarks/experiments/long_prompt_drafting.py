"""Drafting on long prompts: the model draft with adaptive K and at fixed K, and auto, beside plain.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/experiments/long_prompt_drafting.py [--workload long-context]

Starts the default stack (prefix caching on, as shipped: the draft's later catch-ups on the
same handbook find it cached) and runs each prompt of the workload alone and greedy, once per
variant in rotating order, `--repeats` times: plain, the model draft with the planner's K, the
model draft at a fixed K of 8 and of 16, and auto. Prints per request its decode tok/s, rounds,
draft and accepted tokens and the seconds of each phase, then each variant's median tok/s and
pairwise median ratio to plain. Every variant's tokens must equal plain's.
"""

from __future__ import annotations

import argparse
import statistics

from specdec.client import GenerationResult, SpecdecClient
from specdec_bench.results import cpu_model
from specdec_bench.stack import running_stack
from specdec_bench.sweeps import check_exact, method_order
from specdec_bench.workloads import Workload, chat

#: Variant name -> (the request's method, a fixed K or None for the planner's).
VARIANTS: dict[str, tuple[str, int | None]] = {
    "plain": ("none", None), "model": ("model", None), "model, K = 8": ("model", 8),
    "model, K = 16": ("model", 16), "auto": ("auto", None),
}


def run(
    client: SpecdecClient, workload: Workload, repeats: int, max_new_tokens: int
) -> dict[str, list[GenerationResult]]:
    """Every prompt of `workload` once per variant, rotating the order; results by variant."""
    results: dict[str, list[GenerationResult]] = {name: [] for name in VARIANTS}
    turn = 0
    for _ in range(repeats):
        for index, prompt in enumerate(workload.prompts(3)):
            tokens = {}
            for name in method_order(tuple(VARIANTS), turn):
                method, k = VARIANTS[name]
                options = {} if k is None else {"num_speculative_tokens": k, "adaptive": False}
                result = client.generate(chat(prompt), max_new_tokens=max_new_tokens, method=method, **options)
                results[name].append(result)
                tokens[name] = result.token_ids
                phases = ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in result.anatomy.items())
                print(f"  prompt {index} {name:14} {result.tokens_per_s:6.1f} tok/s  rounds {result.num_rounds:3d}  "
                      f"drafted {result.num_draft_tokens:4d}  accepted {result.num_accepted_tokens:4d}  s: {phases}")
            for name in VARIANTS:
                check_exact(index, name, tokens[name], tokens["plain"])
            turn += 1
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default=Workload.LONG_CONTEXT.value, choices=[w.value for w in Workload])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    with running_stack(gateway_args="--speculation-method auto") as stack:
        with SpecdecClient(stack.gateway.address) as client:
            client.generate("Hello", max_new_tokens=8, method="auto")
            print(f"{cpu_model()}; {args.workload}, {args.repeats} repeat(s), {args.max_new_tokens} new tokens, greedy")
            results = run(client, Workload(args.workload), args.repeats, args.max_new_tokens)
    print("variant, median tok/s, pairwise median ÷ plain")
    for name, runs in results.items():
        ratio = statistics.median(r.tokens_per_s / p.tokens_per_s for r, p in zip(runs, results["plain"]))
        print(f"  {name:14} {statistics.median(r.tokens_per_s for r in runs):6.1f}  {ratio:5.2f}x")


if __name__ == "__main__":
    main()
