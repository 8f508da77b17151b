"""Auto with and without learned edits, beside plain decoding and the model draft, on one stack.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/experiments/lookup_edits.py [--workload chat]
        [--prompts 6] [--repeats 2] [--max-new-tokens 128]

Starts the default stack and a second gateway on the same target and draft with
`--lookup-edits 0` (both with the suffix cache off, since every prompt is sent once per
variant). Each prompt of the workload runs greedy and alone once per variant, in rotating
order (`guided_drafting.run_workload`): plain, the model draft, auto without edits, auto.
Every variant's tokens must equal plain's. Prints what `guided_drafting.py` prints per variant,
and the pairwise median of auto with ÷ without edits.
"""

from __future__ import annotations

import argparse

from guided_drafting import Variants, pairwise, report, run_workload

from specdec.client import SpecdecClient
from specdec_bench.results import cpu_model
from specdec_bench.stack import NO_SUFFIX_CACHE, running_stack, start_service
from specdec_bench.workloads import Workload

#: The other gateway (1) runs without learned edits.
VARIANTS: Variants = {
    "plain": (0, "none", None), "model": (0, "model", None), "auto, no edits": (1, "auto", None),
    "auto": (0, "auto", None),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=[w.value for w in Workload], default="chat")
    parser.add_argument("--prompts", type=int, default=6, help="chat prompts (the other workloads use all theirs)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    workload = Workload(args.workload)
    with running_stack() as stack:
        no_edits = start_service("specdec.gateway", [
            "--target-address", stack.target.address, "--draft-address", stack.draft.address,
            "--log-level", "WARNING", *NO_SUFFIX_CACHE, "--lookup-edits", "0",
        ])
        try:
            address = no_edits.wait_ready().address
            with SpecdecClient(stack.address) as edits, SpecdecClient(address) as plain_lookup:
                results, _ = run_workload([edits, plain_lookup], VARIANTS, workload, args.repeats,
                                          args.max_new_tokens, turn=0, chat_prompts=args.prompts)
        finally:
            no_edits.stop()
    print(f"{cpu_model()}; {args.repeats} repeat(s), {args.max_new_tokens} new tokens, greedy")
    report(workload, results)
    print(f"auto with ÷ without edits: {pairwise(results, 'auto', 'auto, no edits'):.3f}")


if __name__ == "__main__":
    main()
