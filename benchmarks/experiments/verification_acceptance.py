"""What drawn verification costs in acceptance against rejection sampling, on the default stack.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/experiments/verification_acceptance.py

Sends the bench's chat prompts, seeded and sampled at a few temperatures, through the default
stack (the int4 self-draft) with the model draft at a fixed K, once judged by rejection
sampling and once by drawn verification (the target's own seeded draws), and prints the share
of draft tokens each kept and the tokens a round emitted. Acceptance does not depend on the
machine's speed, so the figures hold on a busy machine; each pair of requests shares its seed.
"""

from __future__ import annotations

import argparse

from specdec.client import SpecdecClient
from specdec_bench.stack import running_stack
from specdec_bench.workloads import Workload, chat

VERIFICATIONS = ("rejection", "drawn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8, help="chat prompts of the bench workload")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4, help="draft tokens a round (fixed, not adaptive)")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.3, 0.7, 1.0])
    args = parser.parse_args()
    prompts = Workload.CHAT.prompts(args.prompts)[: args.prompts]
    print(f"{'temperature':>11} {'verification':>12} {'acceptance':>10} {'tokens/round':>12}")
    with running_stack() as stack, SpecdecClient(stack.address) as client:
        for temperature in args.temperatures:
            for verification in VERIFICATIONS:
                drafted = accepted = rounds = 0
                for seed, prompt in enumerate(prompts):
                    result = client.generate(
                        chat(prompt), max_new_tokens=args.max_new_tokens, temperature=temperature, seed=seed,
                        method="model", num_speculative_tokens=args.k, adaptive=False, verification=verification,
                    )
                    drafted += result.num_draft_tokens
                    accepted += result.num_accepted_tokens
                    rounds += result.num_rounds
                print(f"{temperature:>11} {verification:>12} {accepted / max(drafted, 1):>10.3f} "
                      f"{(accepted + rounds) / max(rounds, 1):>12.2f}")


if __name__ == "__main__":
    main()
