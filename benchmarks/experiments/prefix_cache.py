"""What automatic prefix caching saves, side by side: the same chat turns through two stacks,
one with `--prefix-caching` (the default) and one with `--no-prefix-caching`.

    .venv/bin/python benchmarks/experiments/prefix_cache.py [--tokens 64]

Both stacks (target, draft, gateway each) are started one service after another; requests
then alternate between them. Each chat prompt of the benchmark is sent as a first turn
(new to the cache, apart from the chat template's system prompt, which every conversation
shares) and then as a second turn that carries the first answer and a follow-up question
(all of turn one is cached). Printed per turn: the median time to first token (the target's
prefill) and decode tokens/s of speculative decoding (which pays the draft's prefill of the
prompt in its first round), for each stack, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from specdec.client import SpecdecClient
from specdec_bench.results import lscpu
from specdec_bench.stack import Stack, running_stack
from specdec_bench.workloads import PROMPTS

FOLLOW_UP = "Thank you. Can you say that again in two sentences?"


@contextmanager
def stacks() -> Iterator[dict[str, Stack]]:
    with ExitStack() as stack:
        yield {
            "cached": stack.enter_context(running_stack()),
            "computed": stack.enter_context(running_stack("--no-prefix-caching", "--no-prefix-caching")),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per turn")
    args = parser.parse_args()
    cpu = lscpu()
    print("CPU:", ", ".join(f"{k} {cpu.get(k, '?')}" for k in ("Model name", "CPU family", "Model", "CPU(s)")))
    ttft: dict[tuple[str, int], list[float]] = {}
    rate: dict[tuple[str, int], list[float]] = {}
    with stacks() as running:
        clients = {name: SpecdecClient(s.address) for name, s in running.items()}
        for client in clients.values():
            client.generate("warm up", max_new_tokens=8)
        for i, prompt in enumerate(PROMPTS):  # one pass: a prompt sent again would be cached whole
            for name in list(clients) if i % 2 == 0 else list(reversed(clients)):
                first_turn = [{"role": "user", "content": prompt}]
                first = clients[name].generate(first_turn, max_new_tokens=args.tokens)
                second_turn = [*first_turn, {"role": "assistant", "content": first.text},
                               {"role": "user", "content": FOLLOW_UP}]
                second = clients[name].generate(second_turn, max_new_tokens=args.tokens)
                for turn, result in ((1, first), (2, second)):
                    ttft.setdefault((name, turn), []).append(result.time_to_first_token_s)
                    rate.setdefault((name, turn), []).append(result.tokens_per_s)
        for client in clients.values():
            client.close()
    print(f"{'turn':<6}{'ttft ms cached':>16}{'computed':>10}{'ratio':>8}"
          f"{'tok/s cached':>15}{'computed':>10}{'ratio':>8}")
    for turn in (1, 2):
        t = {name: 1e3 * statistics.median(ttft[(name, turn)]) for name in ("cached", "computed")}
        r = {name: statistics.median(rate[(name, turn)]) for name in ("cached", "computed")}
        print(f"{turn:<6}{t['cached']:>16.1f}{t['computed']:>10.1f}{t['cached'] / t['computed']:>7.2f}x"
              f"{r['cached']:>15.1f}{r['computed']:>10.1f}{r['cached'] / r['computed']:>7.2f}x")


if __name__ == "__main__":
    main()
