"""What lookup drafting costs the gateway per round: proposals for 16 requests, and the K
planner's choice of source, against the plan without lookups.

    .venv/bin/python benchmarks/experiments/lookup_cost.py [--requests 16] [--rounds 300]

Each request's prompt is ~2,000 tokens of this repository's docs (the embedded tokenizer);
each round appends 1-9 tokens to every request (copied from its prompt, as an answer that
quotes it would, or drawn at random), and the suffix cache holds 65,536 recorded output tokens.
Prints the median and p90 microseconds per round of `LookupProposer.propose` over all requests,
of `Planner.plan` with and without their proposals, and the CPU model.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from specdec.cost_model import ForwardCost
from specdec.gateway.detokenizer import StopStringDetokenizer
from specdec.gateway.planner import Planner, RoundInputs
from specdec.gateway.proposers import LookupDraft, LookupProposer, LookupSettings
from specdec.gateway.request import Request
from specdec.model.choices import DEFAULT_MODEL
from specdec.model.loader import load_tokenizer
from specdec.sampling.params import SamplingParams
from specdec_bench.results import cpu_model

PROMPT_TOKENS = 2000
K = 8
#: Costs shaped like a memory-bound target (a 9-token verify 1.3x a step) and a draft at 0.2.
TARGET = [ForwardCost(b, t, 0.040 * (1 + 0.0375 * (t - 1)) * (1 + 0.05 * (b - 1)))
          for b in (1, 4, 16) for t in (1, 5, 9)]
DRAFT = [ForwardCost(b, 1, 0.008 * (1 + 0.05 * (b - 1))) for b in (1, 4, 16)]


def corpus_tokens() -> list[int]:
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    text = "\n".join(path.read_text() for path in sorted(Path("docs").glob("*.md")))
    return list(tokenizer(text)["input_ids"])


def new_request(slot: str, prompt: list[int]) -> Request:
    greedy = SamplingParams()
    return Request(slot_id=slot, prompt=prompt, sampling=greedy, max_new_tokens=4096, num_speculative_tokens=K,
                    detokenizer=StopStringDetokenizer.__new__(StopStringDetokenizer), generator=None,  # type: ignore[arg-type]
                    draft_sampling=greedy, target_sampling=greedy, adaptive=True)


def grow(seq: Request, rng: random.Random) -> None:
    """One round's tokens: half the time a quote of the prompt, else random tokens."""
    n = rng.randint(1, K + 1)
    if rng.random() < 0.5:
        start = rng.randrange(len(seq.prompt) - n)
        seq.tokens.extend(seq.prompt[start:start + n])
    else:
        seq.tokens.extend(rng.randrange(49152) for _ in range(n))


def percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)
    return f"median {statistics.median(ordered):7.1f} µs, p90 {ordered[int(0.9 * len(ordered))]:7.1f} µs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--max-edits", type=int, default=LookupSettings.max_edits,
                        help="learned edits a request (0 = plain prompt lookup only)")
    args = parser.parse_args()
    rng = random.Random(0)
    corpus = corpus_tokens()
    proposer = LookupProposer(LookupSettings(max_edits=args.max_edits))
    while len(proposer.suffixes) < proposer.settings.suffix_cache_tokens:
        start = rng.randrange(len(corpus) - 300)
        proposer.suffixes.add(corpus[start:start + 8], corpus[start + 8:start + 300])
    seqs = [new_request(f"r{i}", corpus[(s := rng.randrange(len(corpus) - PROMPT_TOKENS)):s + PROMPT_TOKENS])
            for i in range(args.requests)]
    planner = Planner(TARGET, DRAFT)
    caps = {s.slot_id: K for s in seqs}
    for seq in seqs:
        seq.adaptive = True
    propose_us, plan_us, plain_plan_us = [], [], []
    for _ in range(args.rounds):
        for seq in seqs:
            grow(seq, rng)
        started = time.perf_counter()
        lookups: dict[str, LookupDraft] = {}
        for seq in seqs:
            if (draft := proposer.propose(seq.slot_id, seq.tokens, K)) is not None:
                lookups[seq.slot_id] = draft
        propose_us.append(1e6 * (time.perf_counter() - started))
        started = time.perf_counter()
        planner.plan(RoundInputs(seqs, caps, lookups=lookups, lookup_enabled=True))
        plan_us.append(1e6 * (time.perf_counter() - started))
        started = time.perf_counter()
        planner.plan(RoundInputs(seqs, caps))
        plain_plan_us.append(1e6 * (time.perf_counter() - started))
    print(f"{cpu_model()}; {args.requests} requests, prompts of {PROMPT_TOKENS} tokens, K = {K}, "
          f"suffix cache {len(proposer.suffixes)} tokens, {args.rounds} rounds, "
          f"at most {args.max_edits} edits a request")
    print(f"lookup proposals, all requests:  {percentiles(propose_us)}")
    print(f"plan with lookups:               {percentiles(plan_us)}")
    print(f"plan without lookups:            {percentiles(plain_plan_us)}")


if __name__ == "__main__":
    main()
