"""What the draft's own lookup guesses save it, in process, over recorded greedy answers.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/experiments/lookup_acceptance.py record
    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/experiments/draft_lookups.py [--k 16]

Loads the default draft (int4, bf16 activations) and replays each recorded answer
(`lookup_acceptance.py record`: the bench's copy-heavy, long-context and first chat prompts
with their greedy plain answers) as the gateway would drive the draft: each round a Propose of
K tokens, of which the prefix equal to the answer is accepted and the answer's next token is
the bonus. Every answer runs with and without `lookup_guesses`, alternating, `--repeats`
times. Prints per workload the Propose seconds (the set-up prefill excluded), rounds, seconds a
round, the draws whose logits a guessed token's forward gave (steps saved) and the guessed
tokens the draft fed. Rounds may differ a little between the two: in bf16 a wider forward
rounds the logits differently, so a near tie can draft another token.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import torch

from specdec.draft_server.config import DraftConfig
from specdec.draft_server.engine import DraftEngine
from specdec.model.runtime import build_runtime
from specdec.prompt_lookup import common_prefix_length
from specdec.sampling.params import SamplingParams
from specdec.wire.items import ProposeItem
from specdec_bench.results import cpu_model

GREEDY = SamplingParams(temperature=0.0)


def replay(draft: DraftEngine, slot: str, prompt: list[int], answer: list[int], k: int, own: bool) -> list[float]:
    """Seconds of Propose, rounds, steps saved and own guessed tokens fed for one answer."""
    draft.propose([ProposeItem(slot, 0, prompt, 1, GREEDY)])  # the prefill, not timed
    valid, emitted, seconds, rounds, saved, fed = len(prompt), 1, 0.0, 0, 0, 0
    while emitted < len(answer):
        context = prompt + answer[:emitted]
        k_now = min(k, len(answer) - emitted)
        started = time.perf_counter()
        proposal = draft.propose([ProposeItem(slot, valid, context[valid:], k_now, GREEDY, lookup_guesses=own)])[0]
        seconds += time.perf_counter() - started
        rounds, saved, fed = rounds + 1, saved + proposal.saved_steps, fed + proposal.own_guess_tokens
        truth = answer[emitted : emitted + k_now]
        kept = common_prefix_length(proposal.tokens, truth)
        valid = min(proposal.cached_len, len(context) + kept)  # the draft's cache agrees up to here
        emitted += kept + 1
    draft.release(slot)
    return [seconds, rounds, saved, fed]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=Path, default=Path("/tmp/lookup_traces.json"))
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--guess-tokens", type=int, default=DraftConfig.lookup_guess_tokens)
    parser.add_argument("--min-match", type=int, default=DraftConfig.lookup_guess_min_match)
    args = parser.parse_args()

    runtime = build_runtime("smollm2-135m", dtype="bfloat16", quantization="int4")
    config = DraftConfig(port=0, dtype="bfloat16", quantization="int4", measure_costs=False, kv_token_budget=8192,
                         lookup_guess_tokens=args.guess_tokens, lookup_guess_min_match=args.min_match)
    draft = DraftEngine(runtime, config)
    records = json.loads(args.traces.read_text())
    totals: dict[tuple[str, bool], list[float]] = collections.defaultdict(lambda: [0.0] * 4)
    for repeat in range(args.repeats):
        for record in records:
            for own in ((False, True) if repeat % 2 == 0 else (True, False)):
                slot = f"{record['workload']}-{record['prompt']}-{own}"
                figures = replay(draft, slot, record["prompt_ids"], record["answer"], args.k, own)
                totals[record["workload"], own] = [a + b for a, b in zip(totals[record["workload"], own], figures)]
    print(f"{cpu_model()}; torch threads {torch.get_num_threads()}; K = {args.k}, {args.repeats} repeat(s), "
          f"guesses of up to {args.guess_tokens} tokens a step from matches of {args.min_match}+")
    print("workload, own guesses: Propose s, rounds, ms a round, steps saved, own guessed tokens fed")
    for (workload, own), (seconds, rounds, saved, fed) in sorted(totals.items()):
        print(f"  {workload:13s} {'on ' if own else 'off'}  {seconds:7.2f} s  {int(rounds):4d}  "
              f"{1000 * seconds / rounds:6.1f} ms  {int(saved):4d}  {int(fed):5d}")


if __name__ == "__main__":
    main()
