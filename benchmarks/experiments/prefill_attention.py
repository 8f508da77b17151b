"""Time to first token of a long chat prompt, and the decode and verify steps after it, for each
attention kernel and prefill chunk size, beside transformers' own SDPA forward on the same weights.

    .venv/bin/python benchmarks/experiments/prefill_attention.py [--tokens 2000] [--repeats 5]

In process, the default target (`smollm2-135m`, fp32) through `build_runtime`. Each variant
prefills the prompt into a fresh slot (its time to first token: the last position's logits),
in one forward or in chunks, with nothing cached or with the chat opening every conversation
shares in the prefix cache (as the services find it); and times a 1-token decode step and a
(K+1)-token verify step at the end of that context and at a short one.
transformers runs one forward over the prompt with `attn_implementation="sdpa"`, keeping the
last position's logits as generate does. The variants run interleaved, one round each per
repetition, with freed memory kept in the process as the services keep it; medians are
printed with the CPU's name, and the largest difference between
each variant's prompt logits and the reference kernel's (`gather`, one forward).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.model.attention import AttentionKernel, make_attention
from specdec.model.chat import encode_chat
from specdec.model.llama import PagedLlama
from specdec.model.runtime import build_runtime
from specdec.tuning.heap import retain_freed_memory
from specdec_bench.results import lscpu
from specdec_bench.workloads import PROMPTS

K = 8
#: The context of the short steps: a chat prompt of a few lines.
SHORT = 128
#: Prompt tokens a variant finds in the prefix cache: the chat template's opening that
#: every conversation shares (two blocks).
SHARED_OPENING = 32


@dataclass(frozen=True)
class Variant:
    label: str
    kernel: AttentionKernel
    chunk_tokens: int
    cached: int = 0  # leading prompt tokens already in the prefix cache


#: The reference first (the computation before the seam), then what serving runs.
VARIANTS = (
    Variant("gather, one forward", AttentionKernel.GATHER, 1 << 30),
    Variant("gather, chunks of 512", AttentionKernel.GATHER, 512),
    Variant("sdpa, one forward", AttentionKernel.SDPA, 1 << 30),
    Variant("sdpa, chunks of 1024", AttentionKernel.SDPA, 1024),
    Variant("sdpa, chunks of 512", AttentionKernel.SDPA, 512),
    Variant("sdpa, opening cached", AttentionKernel.SDPA, 1 << 30, SHARED_OPENING),
)


def long_chat(tokenizer: object, tokens: int) -> list[int]:
    """A one-turn chat of about `tokens` tokens: the benchmark prompts over and over, numbered."""
    text, ids = "", []
    for i in range(10_000):
        text += f" {PROMPTS[i % len(PROMPTS)]} (part {i + 1})"
        ids = encode_chat(tokenizer, [{"role": "user", "content": text}])  # type: ignore[arg-type]
        if len(ids) >= tokens:
            break
    return ids


def variant_steps(forward: PagedLlama, prompt: list[int], variant: Variant) -> dict[str, Callable]:
    """The timed steps of one variant, on slots of its own pool: the prefill, and a decode and
    a verify step at a long and at a short context."""
    cache = forward.new_cache(token_budget=2 * len(prompt) + SHORT + 64)
    long = len(prompt) - K - 1

    def use() -> None:
        forward.attention = make_attention(variant.kernel)

    def prefill() -> torch.Tensor:
        use()
        prefix = cache.blocks.cached_prefix(prompt) if variant.cached else []
        cache.blocks.allocate("prompt", prefix)
        try:
            rest = prompt[len(prefix) * cache.block_size :]
            return forward.run(cache, [("prompt", rest)], chunk_tokens=variant.chunk_tokens)[0]
        finally:
            cache.blocks.free("prompt")

    def step(width: int, context: int) -> Callable[[], None]:
        slot = f"{context}"

        def run() -> None:
            use()
            cache.blocks.truncate_to(slot, context)
            forward.run(cache, [(slot, prompt[context : context + width])], logits="all", prompt=False)
        return run

    use()
    if variant.cached:  # a conversation before this one left the opening's blocks
        cache.blocks.allocate("opening")
        forward.run(cache, [("opening", prompt[: variant.cached])])
        cache.blocks.register_full_blocks("opening", prompt[: variant.cached])
        return {"prefill": prefill}
    for context in (long, SHORT):
        cache.blocks.allocate(f"{context}")
        forward.run(cache, [(f"{context}", prompt[: context + K + 1])])
    return {"prefill": prefill, "decode": step(1, long), "verify": step(K + 1, long),
            f"decode@{SHORT}": step(1, SHORT), f"verify@{SHORT}": step(K + 1, SHORT)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000, help="prompt length, about")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    args = parser.parse_args()
    cpu = lscpu()
    print("CPU:", ", ".join(f"{k} {cpu.get(k, '?')}" for k in ("Model name", "CPU family", "Model", "CPU(s)")),
          f"| torch {torch.__version__}, {torch.get_num_threads()} threads")
    retain_freed_memory()  # as the services do: a prefill's large tensors are not page-faulted in anew each time
    runtime = build_runtime("smollm2-135m", dtype="float32")
    forward, model = runtime.model, runtime.loaded.model
    prompt = long_chat(runtime.loaded.tokenizer, args.tokens)
    print(f"prompt: {len(prompt)} tokens; verify: {K + 1} tokens")
    model.set_attn_implementation("sdpa")

    def transformers_prefill() -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([prompt]), logits_to_keep=1).logits[0, -1]

    steps = {variant.label: variant_steps(forward, prompt, variant) for variant in VARIANTS}
    times: dict[tuple[str, str], list[float]] = {}
    logits: dict[str, torch.Tensor] = {}
    for _ in range(args.repeats):
        started = time.perf_counter()
        logits["transformers sdpa"] = transformers_prefill()
        times.setdefault(("transformers sdpa", "prefill"), []).append(time.perf_counter() - started)
        for label, runs in steps.items():
            for name, run in runs.items():
                started = time.perf_counter()
                out = run()
                times.setdefault((label, name), []).append(time.perf_counter() - started)
                if name == "prefill":
                    logits[label] = out
    reference = logits[VARIANTS[0].label]
    names = max((list(runs) for runs in steps.values()), key=len)
    print("median ms;", f"decode and verify at {len(prompt) - K - 1} tokens of context, @{SHORT} at {SHORT}")
    print(f"{'variant':<24}" + "".join(f"{name:>12}" for name in names) + f"{'max |dlogit|':>14}")
    for label in ["transformers sdpa", *steps]:
        cells = [f"{1e3 * statistics.median(times[(label, name)]):.1f}" if (label, name) in times else "-"
                 for name in names]
        diff = float((logits[label].float() - reference.float()).abs().max())
        print(f"{label:<24}" + "".join(f"{cell:>12}" for cell in cells) + f"{diff:>14.2e}")


if __name__ == "__main__":
    main()
