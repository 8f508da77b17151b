"""A/B of service settings through the real stack, side by side in one run.

    .venv/bin/python benchmarks/experiments/service_settings.py [--tokens 64] [--rounds 2]
        --variant "int8:--quantization int8 --dtype bfloat16" --variant "int4:--quantization int4 --dtype bfloat16"
        [--variant "passive:...:OMP_WAIT_POLICY=PASSIVE"]

Each variant is `name:draft flags[:ENV=value,...]`; the environment applies to both model
services. For each variant the trio is started, then single-request greedy generations
alternate speculative (fixed K, adaptive off) and plain over the same prompts, and the
median tokens/s of each mode, their ratio and the acceptance are printed. Settings that
change how the services share the cores (thread counts, OpenMP wait policy, pinning) can
only be judged this way: in-process timings of one model alone do not see the other.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from specdec.cli.launcher import start_service
from specdec.client import SpecdecClient
from specdec.gateway.config import GatewayConfig
from specdec.gateway.server import create_gateway

PROMPTS = [
    "Give three reasons why people keep a garden.",
    "Summarize how a bicycle gear system works.",
    "What makes a good cup of tea?",
    "Describe a quiet morning in a small harbour town.",
]


@contextmanager
def environment(changes: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the children started inside the block."""
    saved = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_variant(draft_flags: list[str], env: dict[str, str], args: argparse.Namespace) -> dict[str, float]:
    with environment(env):
        target = start_service("specdec.target_server", ["--log-level", "WARNING", *args.target_flags.split()])
        draft = start_service("specdec.draft_server", ["--log-level", "WARNING", *draft_flags])
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        target.wait_ready(), draft.wait_ready()
        config = GatewayConfig(target_address=target.address, draft_address=draft.address, port=0,
                               num_speculative_tokens=args.k)
        gateway = asyncio.run_coroutine_threadsafe(create_gateway(config), loop).result()
        spec, plain, alpha = [], [], []
        with SpecdecClient(f"127.0.0.1:{gateway.port}") as client:
            client.generate([{"role": "user", "content": "warm up"}], max_new_tokens=8)
            for _ in range(args.rounds):
                for prompt in PROMPTS:
                    chat = [{"role": "user", "content": prompt}]
                    s = client.generate(chat, max_new_tokens=args.tokens, num_speculative_tokens=args.k, adaptive=False)
                    p = client.generate(chat, max_new_tokens=args.tokens, speculative=False)
                    if s.token_ids != p.token_ids:
                        raise SystemExit(f"greedy outputs differ on {prompt!r}: exactness is broken")
                    spec.append(s.tokens_per_s)
                    plain.append(p.tokens_per_s)
                    alpha.append(s.num_accepted_tokens / max(1, s.num_draft_tokens))
        asyncio.run_coroutine_threadsafe(gateway.stop(1.0), loop).result()
    finally:
        draft.stop()
        target.stop()
    return {"spec": statistics.median(spec), "plain": statistics.median(plain), "alpha": statistics.mean(alpha)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", required=True, help="name:draft flags[:ENV=value,...]")
    parser.add_argument("--target-flags", default="", help="flags for the target service")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("-k", type=int, default=4, help="fixed K of the speculative runs")
    args = parser.parse_args()
    rows = []
    for spec in args.variant:
        name, _, rest = spec.partition(":")
        flags, _, env_spec = rest.partition(":")
        env = dict(item.split("=", 1) for item in env_spec.split(",") if item)
        rows.append((name, run_variant(flags.split(), env, args)))
    print(f"{'variant':<16}{'plain tok/s':>12}{'spec tok/s':>12}{'speedup':>9}{'alpha':>8}")
    for name, r in rows:
        print(f"{name:<16}{r['plain']:>12.1f}{r['spec']:>12.1f}{r['spec'] / r['plain']:>8.2f}x{r['alpha']:>8.3f}")


if __name__ == "__main__":
    main()
