"""A lookup first and the model continuing, against the model draft alone and auto without
guesses, side by side on the bench's workloads.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/experiments/guided_drafting.py [--workloads copy-heavy]

Starts the default target and draft with two gateways on them: one as shipped (auto may give
the draft a request's lookup as a guess) and one with `--no-lookup-guesses`. Each prompt runs
alone and greedy, once per variant in rotating order, `--repeats` times: plain, model draft,
auto without guesses, auto. Prints decode tok/s, each variant's pairwise median ratio to plain
and to the model draft, and per variant the rounds, lookup rounds, guided rounds and the draft
tokens the guesses gave. Every variant's tokens must equal plain's.
"""

from __future__ import annotations

import argparse
import shlex
import statistics

from specdec.client import GenerationResult, SpecdecClient
from specdec_bench.results import cpu_model
from specdec_bench.stack import NO_SUFFIX_CACHE, running_stack, start_service
from specdec_bench.sweeps import check_exact, method_order
from specdec_bench.workloads import Workload, chat

#: Variant name -> (gateway: 0 as shipped, 1 the other; the request's method; its largest K,
#: None for the gateway's).
Variants = dict[str, tuple[int, str, int | None]]
#: Here the other gateway runs without guesses.
VARIANTS: Variants = {
    "plain": (0, "none", None), "model": (0, "model", None), "auto, no guesses": (1, "auto", None),
    "auto": (0, "auto", None),
}


def run_workload(
    clients: list[SpecdecClient], variants: Variants, workload: Workload, repeats: int, max_new_tokens: int,
    turn: int, chat_prompts: int = 3,
) -> tuple[dict[str, list[GenerationResult]], int]:
    """Every prompt of `workload` once per variant (which needs "plain"), rotating the order;
    results by variant."""
    results: dict[str, list[GenerationResult]] = {name: [] for name in variants}
    for _ in range(repeats):
        for index, prompt in enumerate(workload.prompts(chat_prompts)):
            tokens = {}
            for name in method_order(tuple(variants), turn):
                gateway, method, k = variants[name]
                options = {} if k is None else {"num_speculative_tokens": k, "adaptive": True}
                result = clients[gateway].generate(chat(prompt), max_new_tokens=max_new_tokens, method=method,
                                                   **options)
                results[name].append(result)
                tokens[name] = result.token_ids
            for name in variants:
                check_exact(index, f"{workload.value} {name}", tokens[name], tokens["plain"])
            turn += 1
    return results, turn


def pairwise(results: dict[str, list[GenerationResult]], name: str, baseline: str) -> float:
    return statistics.median(r.tokens_per_s / b.tokens_per_s for r, b in zip(results[name], results[baseline]))


def report(workload: Workload, results: dict[str, list[GenerationResult]]) -> None:
    """Each variant's figures (the results need "plain" and "model")."""
    print(f"\n{workload.value}: variant, median tok/s, ÷ plain, ÷ model, rounds / lookup / guided, "
          "draft tokens, of them guessed, acceptance")

    def total(name: str, field: str) -> int:
        return sum(getattr(r, field) for r in results[name])

    for name in results:
        drafted = total(name, "num_draft_tokens")
        print(f"  {name:18} {statistics.median(r.tokens_per_s for r in results[name]):6.1f}"
              f"  {pairwise(results, name, 'plain'):5.2f}x  {pairwise(results, name, 'model'):5.2f}x"
              f"  {total(name, 'num_rounds'):4d} / {total(name, 'num_lookup_rounds'):3d} / "
              f"{total(name, 'num_guided_rounds'):3d}  {drafted:5d}  {total(name, 'num_guessed_tokens'):4d}"
              f"  {total(name, 'num_accepted_tokens') / max(1, drafted):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--workloads", nargs="+", default=[w.value for w in Workload],
                        choices=[w.value for w in Workload])
    parser.add_argument("--gateway-args", default="", help="more flags for both gateways")
    parser.add_argument("--also-k", type=int, default=0,
                        help="also run model and auto with this largest K per request (0: no)")
    args = parser.parse_args()
    if args.also_k:
        VARIANTS.update({f"model, K <= {args.also_k}": (0, "model", args.also_k),
                         f"auto, K <= {args.also_k}": (0, "auto", args.also_k)})
    with running_stack(gateway_args=f"--speculation-method auto {args.gateway_args}") as stack:
        unguided = start_service("specdec.gateway", [
            "--target-address", stack.target.address, "--draft-address", stack.draft.address,
            "--log-level", "WARNING", "--speculation-method", "auto", *NO_SUFFIX_CACHE, "--no-lookup-guesses",
            *shlex.split(args.gateway_args),
        ])
        try:
            second = unguided.wait_ready()
            with SpecdecClient(stack.gateway.address) as first_client, SpecdecClient(second.address) as client:
                for warm in (first_client, client):
                    warm.generate("Hello", max_new_tokens=8, method="auto")
                print(f"{cpu_model()}; {args.repeats} repeat(s), {args.max_new_tokens} new tokens, greedy, "
                      f"adaptive K, suffix cache off {args.gateway_args}")
                turn = 0
                for value in args.workloads:
                    results, turn = run_workload([first_client, client], VARIANTS, Workload(value), args.repeats,
                                                 args.max_new_tokens, turn)
                    report(Workload(value), results)
        finally:
            unguided.stop()


if __name__ == "__main__":
    main()
