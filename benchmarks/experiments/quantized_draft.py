"""Quantized self-draft vs its target: greedy agreement α and decode tokens/s, one run side by side.

    .venv/bin/python benchmarks/experiments/quantized_draft.py [--tokens 64] [--model smollm2-135m]

α is measured by teacher forcing: the target's greedy continuation is fed to the draft in
one pass and α is the fraction of positions where the draft's argmax equals the target's
next token — the per-token acceptance probability of greedy speculative decoding.
Tokens/s is single-request greedy decoding through our paged forward (one token per step);
c is a step's cost relative to the fp32 target's (the draft cost ratio of the speed model).
"""

from __future__ import annotations

import argparse
import time

import torch

from specdec.model.chat import encode_chat
from specdec.model.runtime import ModelRuntime, build_runtime

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue in two sentences.",
    "List three tips for writing clean Python code.",
    "What is the capital of Australia, and why was it chosen?",
]


def greedy_decode(runtime: ModelRuntime, prompt: list[int], n: int) -> tuple[list[int], float]:
    """Greedy continuation of `prompt` and the decode rate in tokens/s (prefill excluded)."""
    cache = runtime.model.new_cache(token_budget=len(prompt) + n + 16)
    cache.blocks.allocate("bench")
    logits = runtime.model.run(cache, [("bench", prompt)])[0]
    out = [int(logits.argmax())]
    start = time.perf_counter()
    while len(out) < n:
        logits = runtime.model.run(cache, [("bench", [out[-1]])])[0]
        out.append(int(logits.argmax()))
    return out, (n - 1) / (time.perf_counter() - start)


def agreement(draft: ModelRuntime, prompt: list[int], continuation: list[int]) -> float:
    cache = draft.model.new_cache(token_budget=len(prompt) + len(continuation) + 16)
    cache.blocks.allocate("alpha")
    logits = draft.model.run(cache, [("alpha", prompt + continuation[:-1])], logits="all")[0]
    guesses = logits[len(prompt) - 1 :].argmax(-1)  # [len(continuation)]
    return float((guesses == torch.tensor(continuation)).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    variants = {
        "target fp32": build_runtime(args.model, dtype="float32"),
        "bf16": build_runtime(args.model, dtype="bfloat16"),
        "draft int8 (bf16 act.)": build_runtime(args.model, dtype="bfloat16", quantization="int8"),
        "draft int4 (bf16 act.)": build_runtime(args.model, dtype="bfloat16", quantization="int4"),
    }
    tokenizer = variants["target fp32"].loaded.tokenizer
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    rates: dict[str, list[float]] = {name: [] for name in variants}
    alphas: dict[str, list[float]] = {name: [] for name in variants if name != "target fp32"}
    for prompt in prompts:  # interleave variants per prompt so machine noise hits all alike
        reference, rate = greedy_decode(variants["target fp32"], prompt, args.tokens)
        rates["target fp32"].append(rate)
        for name, runtime in variants.items():
            if name == "target fp32":
                continue
            rates[name].append(greedy_decode(runtime, prompt, args.tokens)[1])
            alphas[name].append(agreement(runtime, prompt, reference))
    base = sum(rates["target fp32"]) / len(prompts)
    print(f"{'variant':<24}{'tok/s':>8}{'vs fp32':>9}{'c':>7}{'alpha':>8}")
    for name in variants:
        rate = sum(rates[name]) / len(prompts)
        alpha = f"{sum(alphas[name]) / len(prompts):.3f}" if name in alphas else "-"
        print(f"{name:<24}{rate:>8.1f}{rate / base:>8.2f}x{base / rate:>7.2f}{alpha:>8}")


if __name__ == "__main__":
    main()
