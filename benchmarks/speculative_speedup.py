"""Decode speed with and without speculation, measured side by side in one run.

    .venv/bin/python benchmarks/speculative_speedup.py [--tokens 96] [--spec-length 4] [--rounds 2] [--concurrency 1]

Starts the real trio (target fp32, int8 draft, gateway) as `specdec serve` would, then
alternates speculative and plain greedy runs over the same prompts so machine noise hits
both alike. With --concurrency 1 it reports single-request tokens/s (after the first
token); with N > 1 it sends N requests at once and reports aggregate tokens/s (all
completion tokens over the wall time of the batch).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from gateway.config import GatewayConfig
from gateway.launcher import start_service
from gateway.server import create_gateway
from specdec.client import SpecdecClient

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue.",
    "List five tips for writing clean Python code.",
    "Describe the water cycle for a ten-year-old.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--spec-length", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    parser.add_argument("--spec-disable-batch-size", type=int, default=0,
                        help="the gateway setting; 0 (default here) speculates at any batch size")
    parser.add_argument("--draft-args", default="", help="extra flags for the draft service")
    args = parser.parse_args()
    target = start_service("target_server", ["--dtype", "float32"])
    draft = start_service("draft_server", args.draft_args.split())
    target.wait_ready(), draft.wait_ready()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        config = GatewayConfig(target_address=target.address, draft_address=draft.address, port=0,
                               spec_length=args.spec_length, spec_disable_batch_size=args.spec_disable_batch_size)
        gateway = asyncio.run_coroutine_threadsafe(create_gateway(config), loop).result()
        rates: dict[str, list[float]] = {"speculative": [], "plain": []}
        acceptance, lengths = [], []
        with SpecdecClient(f"127.0.0.1:{gateway.port}") as client:
            client.generate([{"role": "user", "content": "warm up"}], max_new_tokens=8)
            for _ in range(args.rounds):
                if args.concurrency > 1:
                    chats = [[{"role": "user", "content": p}] for p in PROMPTS] * (args.concurrency // len(PROMPTS) + 1)
                    chats = chats[: args.concurrency]
                    for mode, options in (("speculative", {"spec_length": args.spec_length}), ("plain", {"speculative": False})):
                        with ThreadPoolExecutor(args.concurrency) as pool:
                            start = time.perf_counter()
                            results = list(pool.map(lambda c, o=options: client.generate(c, max_new_tokens=args.tokens, **o), chats))
                            elapsed = time.perf_counter() - start
                        rates[mode].append(sum(r.completion_tokens for r in results) / elapsed)
                        if mode == "speculative":
                            acceptance += [r.acceptance_rate for r in results]
                            lengths += [r.mean_acceptance_length for r in results]
                    continue
                for prompt in PROMPTS:
                    chat = [{"role": "user", "content": prompt}]
                    spec = client.generate(chat, max_new_tokens=args.tokens, spec_length=args.spec_length)
                    plain = client.generate(chat, max_new_tokens=args.tokens, speculative=False)
                    if spec.token_ids != plain.token_ids:
                        raise SystemExit(f"greedy outputs differ on {prompt!r}: exactness is broken")
                    rates["speculative"].append(spec.tokens_per_s)
                    rates["plain"].append(plain.tokens_per_s)
                    acceptance.append(spec.acceptance_rate)
                    lengths.append(spec.mean_acceptance_length)
        asyncio.run_coroutine_threadsafe(gateway.stop(1.0), loop).result()
    finally:
        draft.stop()
        target.stop()
    spec_rate, plain_rate = statistics.mean(rates["speculative"]), statistics.mean(rates["plain"])
    what = f"{args.concurrency} concurrent requests (aggregate)" if args.concurrency > 1 else "single request"
    print(f"{what}, {args.tokens} greedy tokens each, K={args.spec_length}, {len(rates['plain'])} runs per mode")
    print(f"plain decoding      {plain_rate:6.1f} tok/s")
    print(f"speculative         {spec_rate:6.1f} tok/s   acceptance rate {statistics.mean(acceptance):.3f}, "
          f"mean acceptance length {statistics.mean(lengths):.2f}")
    print(f"speedup             {spec_rate / plain_rate:6.2f}x")


if __name__ == "__main__":
    main()
