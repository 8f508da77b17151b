"""Lookup drafting against the model draft and plain decoding, side by side.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/experiments/lookup_modes.py [--repeats 2]

Starts the default target, draft and gateway (`specdec_bench.stack.running_stack`, adaptive K)
and sends each prompt alone, greedy, `--max-new-tokens` tokens, once per method in turn
(none, model, ngram, auto), `--repeats` times: three copy-heavy prompts, then two chat
prompts that copy nothing. Prints the median decode tok/s per method and prompt, each
method's ratio to plain (pairwise per prompt and repeat, then the median), and the lookups'
share of the draft tokens. The draft service stays up while `ngram` runs (idle).

The suffix cache is off unless `--suffix-cache`: every method answers each prompt with the
same tokens, so from the second answer on the cache would hold the whole answer and the
lookup methods would copy it, which says nothing about distinct requests.
"""

from __future__ import annotations

import argparse
import statistics

from specdec.client import GenerationResult, SpecdecClient
from specdec_bench.results import cpu_model
from specdec_bench.stack import running_stack

PARAGRAPH = (
    "The harbour town woke slowly. Fishing boats came back before dawn, their decks stacked with crates of ice "
    "and silver fish, and the market stalls opened one by one as the bakers carried out trays of warm bread. "
    "By eight the square was full: children on their way to school, old men arguing about the weather, and "
    "tourists photographing the lighthouse that had guided ships into the bay for two hundred years."
)
CODE = '''def compute_total(prices, tax_rate):
    subtotal = 0
    for price in prices:
        subtotal += price
    tax = subtotal * tax_rate
    return subtotal + tax


def print_receipt(prices, tax_rate):
    total = compute_total(prices, tax_rate)
    for price in prices:
        print(f"item: {price:.2f}")
    print(f"total: {total:.2f}")
'''
CSV = "name,city,age,team\nAlice,Paris,31,red\nBob,Berlin,27,blue\nCarla,Madrid,45,red\nDan,Oslo,38,green\n" \
      "Eve,Rome,29,blue\nFrank,Vienna,52,green"
PROMPTS = {
    "repeat": f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
    "rename": f"Rename the function compute_total to sum_prices in this code. Return the whole code.\n\n{CODE}",
    "csv": f"Convert this CSV to a Markdown table:\n\n{CSV}",
}
#: Answers that copy nothing: the lookups must not cost here.
CHAT = {
    "poem": "Write a short poem about autumn leaves.",
    "bike": "Explain how a bicycle's gears work, for a ten-year-old.",
}
METHODS = ("none", "model", "ngram", "auto")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--suffix-cache", action="store_true", help="keep the cross-request suffix cache on")
    args = parser.parse_args()
    gateway_args = "--speculation-method auto" + ("" if args.suffix_cache else " --suffix-cache-tokens 0")
    results: dict[tuple[str, str], list[GenerationResult]] = {}
    with running_stack(gateway_args=gateway_args) as stack, SpecdecClient(stack.address) as client:
        client.generate("Hello", max_new_tokens=8)  # warm-up
        for _ in range(args.repeats):
            for name, prompt in (PROMPTS | CHAT).items():
                for method in METHODS:
                    result = client.generate([{"role": "user", "content": prompt}],
                                             max_new_tokens=args.max_new_tokens, method=method)
                    results.setdefault((name, method), []).append(result)
    print(f"{cpu_model()}; {args.repeats} repeats, {args.max_new_tokens} new tokens, greedy, adaptive K, "
          f"suffix cache {'on' if args.suffix_cache else 'off'}")
    print("prompt  " + "".join(f"{m:>18}" for m in METHODS))
    for name in PROMPTS | CHAT:
        cells = []
        for method in METHODS:
            runs = results[(name, method)]
            share = sum(r.num_lookup_draft_tokens for r in runs) / max(1, sum(r.num_draft_tokens for r in runs))
            cells.append(f"{statistics.median(r.tokens_per_s for r in runs):7.1f} tok/s {share:4.0%}L")
        print(f"{name:8}" + "".join(f"{c:>18}" for c in cells))
    for group, names in (("copy-heavy", PROMPTS), ("chat", CHAT)):
        for method in METHODS[1:]:
            ratios = [r.tokens_per_s / p.tokens_per_s for name in names
                      for r, p in zip(results[(name, method)], results[(name, "none")])]
            print(f"{group}: {method} ÷ plain, pairwise median: {statistics.median(ratios):.2f}x")
        ratios = [a.tokens_per_s / m.tokens_per_s for name in names
                  for a, m in zip(results[(name, "auto")], results[(name, "model")])]
        print(f"{group}: auto ÷ model, pairwise median: {statistics.median(ratios):.2f}x")
    same = all(len({tuple(r.token_ids) for m in METHODS for r in results[(name, m)]}) == 1
               for name in PROMPTS | CHAT)
    print(f"identical tokens in every method: {same}")


if __name__ == "__main__":
    main()
