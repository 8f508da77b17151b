"""Auto with and without learned edits, beside plain decoding and the model draft, on one stack.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/experiments/lookup_edits.py [--workload chat]
        [--prompts 6] [--repetitions 2] [--max-new-tokens 128]

Starts the default stack and a second gateway on the same target and draft with
`--lookup-edits 0` (both with the suffix cache off, since every prompt is sent once per
variant). Each prompt of the workload runs greedy and alone once per variant, the variants in
rotating order: plain, the model draft, auto with edits, auto without. Every variant's tokens
must equal plain's. Prints each pair's tok/s, and the medians of auto ÷ the model draft with
and without edits and of auto with ÷ without.
"""

from __future__ import annotations

import argparse
import statistics
import time

from specdec.cli.launcher import start_service
from specdec.client import SpecdecClient
from specdec_bench.results import cpu_model
from specdec_bench.stack import NO_SUFFIX_CACHE, running_stack
from specdec_bench.workloads import Workload, chat

VARIANTS = ("plain", "model", "auto", "auto, no edits")


def one_prompt(ways: dict[str, tuple[SpecdecClient, str]], order: list[str], prompt: str,
               max_new_tokens: int) -> dict[str, float]:
    """tok/s of each variant on `prompt`, run in `order`; every answer must equal plain's."""
    rates, answers = {}, {}
    for name in order:
        client, method = ways[name]
        started = time.perf_counter()
        result = client.generate(chat(prompt), max_new_tokens=max_new_tokens, method=method)
        rates[name] = len(result.token_ids) / (time.perf_counter() - started)
        answers[name] = list(result.token_ids)
    if any(tokens != answers["plain"] for tokens in answers.values()):
        raise RuntimeError(f"{prompt[:40]!r}…: a variant's answer differs from plain decoding's")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=[w.value for w in Workload], default="chat")
    parser.add_argument("--prompts", type=int, default=6, help="chat prompts (the other workloads use all theirs)")
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    prompts = Workload(args.workload).prompts(args.prompts)
    rates: dict[tuple[int, int], dict[str, float]] = {}
    with running_stack() as stack:
        no_edits = start_service("specdec.gateway", [
            "--target-address", stack.target.address, "--draft-address", stack.draft.address,
            "--log-level", "WARNING", *NO_SUFFIX_CACHE, "--lookup-edits", "0",
        ])
        try:
            address = no_edits.wait_ready().address
            with SpecdecClient(stack.address) as edits, SpecdecClient(address) as plain_lookup:
                ways = {"plain": (edits, "none"), "model": (edits, "model"), "auto": (edits, "auto"),
                        "auto, no edits": (plain_lookup, "auto")}
                for rep in range(args.repetitions):
                    for i, prompt in enumerate(prompts):
                        order = [VARIANTS[(i + j + rep) % len(VARIANTS)] for j in range(len(VARIANTS))]
                        rates[(i, rep)] = one_prompt(ways, order, prompt, args.max_new_tokens)
                        print(f"prompt {i}, repetition {rep}:",
                              ", ".join(f"{name} {rates[(i, rep)][name]:.1f}" for name in VARIANTS), "tok/s")
        finally:
            no_edits.stop()

    def median(top: str, bottom: str) -> float:
        return statistics.median(r[top] / r[bottom] for r in rates.values())

    print(f"{cpu_model()}; {args.workload}, {len(rates)} pairs, {args.max_new_tokens} new tokens")
    print(f"auto ÷ model draft: {median('auto', 'model'):.3f} with edits, {median('auto, no edits', 'model'):.3f} "
          f"without; auto with ÷ without edits {median('auto', 'auto, no edits'):.3f}")


if __name__ == "__main__":
    main()
