"""Why lookup proposals are rejected, and how many tokens a lookup round yields, from recorded
greedy answers: figures that do not depend on the machine's speed.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/experiments/lookup_acceptance.py record
    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/experiments/lookup_acceptance.py replay [--max-edits 0]

`record` starts the default stack and stores each bench workload prompt's (copy-heavy,
long-context, the first chat prompts) token ids and its greedy plain answer in `--traces`.
`reference` stores the copy-heavy prompts with the answers an instruction-following model
would give (the edit done in full: every occurrence renamed, the table converted, each
misspelling corrected), written by the script from the prompts' texts: the small default
model often skips or varies the edit, which hides what learned edits buy.
`served` sends the same prompts through the stack again with lookup drafting alone and
with auto, and counts rounds per request (greedy, so the answers must equal the recorded ones).
`replay` runs the lookup proposer over each answer as greedy lookup-only decoding
would: each round proposes up to `--k` tokens from the prompt and the answer so far (or
nothing), the target keeps the proposal's prefix that equals the answer and adds one token
of its own. Greedy verification keeps exactly that prefix, so rounds, acceptance and tokens
a round are what the gateway would see, with no model run. Each rejected proposal is
classified:

- `other_occurrence`: another earlier occurrence of the same matched tokens would have
  proposed more accepted tokens (the wrong one of several was chosen);
- `short_match`: the match was `--short` tokens or fewer and no occurrence did better;
- `copy_ended`: a longer match, and no occurrence continued like the answer (it stopped copying);
- `first_token`: (any of the above) the very first proposed token was wrong.

With `--policy planner`, K per round is the proposal cut as the K planner cuts it
(`lookup_length` over the planner's own lookup acceptance estimates, learnt afresh per
workload over the replay, threshold `--threshold`) instead of the proposal's full length.
The threshold stands for one verified token's seconds times the batch's tokens per second,
which the gateway measures; `tokens/step` prices each verified draft token at
`--verify-slope` target steps.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from specdec.gateway.planner import Planner
from specdec.gateway.planner.rates import lookup_length
from specdec.gateway.proposers import LookupDraft, LookupProposer, LookupSettings


def record(traces: Path, max_new_tokens: int, chat_prompts: int) -> None:
    from specdec.client import SpecdecClient
    from specdec.model.chat import encode_chat
    from specdec.model.loader import load_tokenizer
    from specdec_bench.stack import running_stack
    from specdec_bench.workloads import Workload, chat

    tokenizer = load_tokenizer("smollm2-135m")
    out = []
    with running_stack() as stack, SpecdecClient(stack.address) as client:
        for workload in Workload:
            for i, prompt in enumerate(workload.prompts(chat_prompts)):
                result = client.generate(chat(prompt), max_new_tokens=max_new_tokens, method="none")
                prompt_ids = encode_chat(tokenizer, chat(prompt))
                if len(prompt_ids) != result.prompt_tokens:
                    raise RuntimeError(f"prompt {i}: {len(prompt_ids)} token ids here, {result.prompt_tokens} served")
                out.append({"workload": workload.value, "prompt": i, "prompt_ids": prompt_ids,
                            "answer": list(result.token_ids)})
                print(workload.value, i, len(prompt_ids), len(result.token_ids), flush=True)
    traces.write_text(json.dumps(out))


def reference_answers() -> list[str]:
    """The copy-heavy prompts' answers with each edit done in full, in `COPY_HEAVY_PROMPTS` order."""
    from specdec_bench import texts

    header, *rows = ("| " + " | ".join(line.split(",")) + " |" for line in texts._CSV.split("\n"))
    table = "\n".join([header, "|---|---|---|---|", *rows])
    spelling = {"recieved": "received", "libary": "library", "Unfortunatly": "Unfortunately", "allready": "already",
                "promissed": "promised", "replacments": "replacements", "Untill": "Until", "availble": "available"}
    past = {"walks": "walked", "buys": "bought", "waits": "waited", "reads": "read", "crosses": "crossed",
            "looks": "looked", "passes": "passed", "answers": "answered", "meets": "met", "plans": "planned"}

    def replaced(text: str, words: dict[str, str]) -> str:
        for old, new in words.items():
            text = text.replace(old, new)
        return text

    return [
        "```python\n" + texts._FUNCTION.replace("total", "star_sum") + "```",
        texts._PARAGRAPH,
        table,
        "```json\n" + texts._JSON.replace('"title"', '"name"') + "\n```",
        replaced(texts._MISSPELT, spelling),
        replaced(texts._PRESENT_TENSE, past),
    ]


def reference(traces: Path) -> None:
    from specdec.model.chat import encode_chat
    from specdec.model.choices import DEFAULT_MODEL
    from specdec.model.loader import load_tokenizer
    from specdec_bench.texts import COPY_HEAVY_PROMPTS
    from specdec_bench.workloads import chat

    tokenizer = load_tokenizer(DEFAULT_MODEL)
    out = [{"workload": "copy-heavy (reference answers)", "prompt": i,
            "prompt_ids": encode_chat(tokenizer, chat(prompt)),
            "answer": tokenizer.encode(answer, add_special_tokens=False)}
           for i, (prompt, answer) in enumerate(zip(COPY_HEAVY_PROMPTS, reference_answers(), strict=True))]
    traces.write_text(json.dumps(out))


def served(traces: Path, max_new_tokens: int, chat_prompts: int) -> None:
    """The recorded prompts through a running stack, greedy, drafting with lookups only (a
    gateway without the draft) and with auto: rounds (speculative and plain), tokens a round,
    what a lookup round proposed and kept, the lookups' acceptance and share of the draft
    tokens per workload, and whether every answer equals the recorded one."""
    from specdec.client import GenerationResult, SpecdecClient
    from specdec_bench.stack import running_stack
    from specdec_bench.workloads import Workload, chat

    records = json.loads(traces.read_text())
    results: dict[tuple[str, str], list[GenerationResult]] = collections.defaultdict(list)
    identical = True
    with running_stack(lookup_gateway=True) as stack:
        assert stack.lookup_gateway is not None
        with SpecdecClient(stack.address) as auto, SpecdecClient(stack.lookup_gateway.address) as ngram:
            for r in records:
                for method, client in (("ngram", ngram), ("auto", auto)):
                    prompt = Workload(r["workload"]).prompts(chat_prompts)[r["prompt"]]
                    result = client.generate(chat(prompt), max_new_tokens=max_new_tokens, method=method)
                    identical &= result.token_ids == r["answer"]
                    results[(r["workload"], method)].append(result)
    for (workload, method), runs in results.items():
        tokens = sum(r.completion_tokens for r in runs)
        rounds = sum(r.num_rounds + r.num_plain_rounds for r in runs)
        lookup_rounds = sum(r.num_lookup_rounds for r in runs)
        lookup_drafted = sum(r.num_lookup_draft_tokens for r in runs)
        lookup_accepted = sum(r.num_lookup_accepted_tokens for r in runs)
        drafted = sum(r.num_draft_tokens for r in runs)
        print(f"{workload:13} {method:6} rounds {rounds:4}  tokens/round {tokens / max(1, rounds):5.2f}  "
              f"lookup rounds {lookup_rounds:4}  proposed/lookup round {lookup_drafted / max(1, lookup_rounds):4.1f}  "
              f"accepted/lookup round {lookup_accepted / max(1, lookup_rounds):4.2f}  "
              f"lookup acceptance {lookup_accepted / max(1, lookup_drafted):5.1%}  "
              f"lookup share of draft tokens {lookup_drafted / max(1, drafted):4.0%}  "
              f"acceptance {sum(r.num_accepted_tokens for r in runs) / max(1, drafted):5.1%}")
    print(f"every answer equals the recorded plain one: {identical}")


@dataclass
class Tally:
    """One workload's replay figures."""

    rounds: int = 0
    emitted: int = 0
    #: Target steps the rounds cost with each verified draft token at `verify_slope` of a step.
    step_cost: float = 0.0
    proposals: int = 0
    proposed: int = 0
    accepted: int = 0
    #: Rejected proposals by cause (see the module docstring).
    causes: collections.Counter[str] = field(default_factory=collections.Counter)
    #: (proposed, accepted) by match length (lengths past 8 pooled as 8).
    by_length: dict[int, list[int]] = field(default_factory=lambda: collections.defaultdict(lambda: [0, 0]))

    def row(self, name: str) -> str:
        return (f"{name:13} rounds {self.rounds:4}  tokens/round {self.emitted / max(1, self.rounds):5.2f}  "
                f"acceptance {self.accepted / max(1, self.proposed):5.1%}  proposals {self.proposals:4}  "
                f"tokens/proposal {self.proposed / max(1, self.proposals):4.1f}  "
                f"accepted/proposal {self.accepted / max(1, self.proposals):4.2f}  "
                f"tokens/step {self.emitted / max(1e-9, self.step_cost):4.2f}")


def common_prefix(a: tuple[int, ...] | list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def best_occurrence(history: list[int], match_len: int, answer_rest: list[int], k: int) -> int:
    """The most tokens any earlier occurrence of history's last `match_len` tokens would have had accepted."""
    suffix, best = history[-match_len:], 0
    for start in range(len(history) - match_len):
        if history[start : start + match_len] == suffix:
            follow = history[start + match_len : start + match_len + k]
            best = max(best, common_prefix(follow, answer_rest))
    return best


def classify(draft: LookupDraft, history: list[int], answer_rest: list[int], k: int, short: int) -> list[str]:
    accepted = common_prefix(draft.tokens, answer_rest)
    causes = ["first_token"] if accepted == 0 else []
    if draft.source.value == "prompt_lookup" and best_occurrence(history, draft.match_len, answer_rest, k) > accepted:
        causes.append("other_occurrence")
    elif draft.match_len <= short:
        causes.append("short_match")
    else:
        causes.append("copy_ended")
    return causes


def replay_one(proposer: LookupProposer, slot: str, prompt: list[int], answer: list[int], k: int, short: int,
               tally: Tally, planner: Planner | None, threshold: float, verify_slope: float) -> None:
    done = 0
    while done < len(answer):
        history, rest = prompt + answer[:done], answer[done:]
        draft = proposer.propose(slot, history, k)
        take = 0
        if draft is not None:
            take = len(draft.tokens)
            if planner is not None:
                take = lookup_length(planner.lookups.alphas(draft), take, threshold)
        accepted = 0
        if take:
            draft = draft.truncated(take) if draft is not None else None
            assert draft is not None
            accepted = common_prefix(draft.tokens, rest)
            tally.proposals += 1
            tally.proposed += take
            tally.accepted += accepted
            cell = tally.by_length[min(draft.match_len, 8)]
            cell[0] += take
            cell[1] += accepted
            if accepted < take and accepted < len(rest):
                tally.causes.update(classify(draft, history, rest, take, short))
            if planner is not None:
                planner.lookups.observe(draft, take, accepted)
        tally.rounds += 1
        tally.step_cost += 1.0 + verify_slope * take
        step = min(accepted + 1, len(rest))
        tally.emitted += step
        done += step
    proposer.forget(slot)


def replay(traces: Path, k: int, short: int, policy: str, threshold: float, verify_slope: float,
           settings: LookupSettings) -> None:
    records = json.loads(traces.read_text())
    print(f"K ≤ {k}, policy {policy} (threshold {threshold}), verify slope {verify_slope}, {settings}")
    for workload in dict.fromkeys(r["workload"] for r in records):
        tally = Tally()
        planner = Planner([], [], uses_draft=False) if policy == "planner" else None  # learnt afresh per workload
        for r in (r for r in records if r["workload"] == workload):
            proposer = LookupProposer(settings)
            replay_one(proposer, "r", r["prompt_ids"], r["answer"], k, short, tally, planner, threshold, verify_slope)
        print(tally.row(workload))
        causes = ", ".join(f"{cause} {count}" for cause, count in tally.causes.most_common())
        print(f"{'':13} rejected proposals by cause: {causes}")
        lengths = "  ".join(f"n={n}: {a}/{p} ({a / max(1, p):.0%})" for n, (p, a) in sorted(tally.by_length.items()))
        print(f"{'':13} accepted/proposed by match length: {lengths}")
        if planner is not None:
            learnt = {f"{source.value} {length}": round(estimate.alpha, 2)
                      for (source, length), estimate in planner.lookups.all()}
            print(f"{'':13} learnt α by match length:", learnt)
    print("median answer tokens:", statistics.median(len(r["answer"]) for r in records))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("record", "reference", "replay", "served"))
    parser.add_argument("--traces", type=Path, default=Path("/tmp/lookup_traces.json"))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--chat-prompts", type=int, default=3)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--short", type=int, default=2, help="match lengths counted as short")
    parser.add_argument("--policy", choices=("full", "planner"), default="full")
    parser.add_argument("--threshold", type=float, default=0.3,
                        help="the planner's cut: a token pays while α^j exceeds this")
    parser.add_argument("--verify-slope", type=float, default=0.1,
                        help="a verified draft token's cost in target steps, for tokens/step")
    parser.add_argument("--min-n", type=int, default=1)
    parser.add_argument("--max-n", type=int, default=4)
    parser.add_argument("--max-edits", type=int, default=LookupSettings.max_edits,
                        help="learned edits a request (0 = plain prompt lookup only)")
    args = parser.parse_args()
    if args.action == "record":
        record(args.traces, args.max_new_tokens, args.chat_prompts)
    elif args.action == "reference":
        reference(args.traces)
    elif args.action == "served":
        served(args.traces, args.max_new_tokens, args.chat_prompts)
    else:
        settings = LookupSettings(min_n=args.min_n, max_n=args.max_n, suffix_cache_tokens=0, max_edits=args.max_edits)
        replay(args.traces, args.k, args.short, args.policy, args.threshold, args.verify_slope, settings)


if __name__ == "__main__":
    main()
