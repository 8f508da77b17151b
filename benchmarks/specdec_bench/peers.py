"""The peers: transformers' own `generate`, plain and assisted, on the same weights and prompts.

Runs in the benchmark process while the stack idles. The target is the model the target
service loads (`build_runtime` with its dtype); the assistant is the very draft the draft
service runs (same model, dtype, quantization and layers, so its quantized Linear
replacements too), drafting a constant K tokens per round. Decode speed is measured like
ours, after the first token: the time of `generate(max_new_tokens=N)` minus that of
`generate(max_new_tokens=1)`, for the N−1 tokens after the first.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specdec.draft_server.config import DraftConfig
from specdec.model.chat import encode_chat
from specdec.model.runtime import ModelRuntime, build_runtime
from specdec.target_server.config import TargetConfig
from specdec.tuning.timing import Clock, device_clock
from specdec_bench.sweeps import Progress
from specdec_bench.workloads import PROMPTS, chat

METHODS = ("hf_plain", "hf_assisted")


@dataclass
class PeerRecord:
    """One timed transformers generation."""

    method: str
    prompt: int
    repetition: int
    completion_tokens: int
    seconds: float
    #: The same call with max_new_tokens=1 (prefill and first token).
    first_token_s: float
    tokens_per_s: float
    #: Token ids equal to our greedy plain output (None: no reference for this prompt).
    matches_ours: bool | None


def _runtime(config: TargetConfig | DraftConfig) -> ModelRuntime:
    precision = config.precision()
    return build_runtime(
        config.model, dtype=precision.dtype, device=config.device, quantization=precision.quantization,
        num_layers=config.num_layers,
    )


def configure_assistant(draft: PreTrainedModel, k: int) -> None:
    """Draft exactly `k` tokens every round. transformers 5.x reads these from the
    assistant's own generation_config (passed to generate() they are silently ignored)."""
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0


def greedy_generate(
    model: PreTrainedModel, ids: torch.Tensor, max_new_tokens: int, eos: int | None, assistant: PreTrainedModel | None
) -> list[int]:
    """transformers' greedy `generate` of `max_new_tokens` after `ids` [1, prompt]; new token ids only."""
    extra = {"assistant_model": assistant} if assistant is not None else {}
    with torch.inference_mode():
        out = model.generate(  # type: ignore[operator]  # transformers' stubs type it as a Tensor
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
            pad_token_id=eos, **extra,
        )  # [1, prompt + new]
    return [int(t) for t in out[0, ids.shape[1]:]]


def _timed(generate: Callable[[], list[int]], clock: Clock) -> tuple[list[int], float]:
    started = clock()
    tokens = generate()
    return tokens, clock() - started


def run_peers(
    target_config: TargetConfig,
    draft_config: DraftConfig,
    *,
    prompts: int,
    max_new_tokens: int,
    k: int,
    repetitions: int,
    reference: Mapping[int, list[int]],
    progress: Progress,
    methods: Sequence[str] = METHODS,
) -> list[PeerRecord]:
    """Greedy generation of every prompt by each of `methods` (plain and assisted by default),
    interleaved, `repetitions` times. The draft is loaded only for assisted generation."""
    progress.set_description("transformers peers (loading)")
    target = _runtime(target_config)
    draft = _runtime(draft_config) if "hf_assisted" in methods else None
    if draft is not None:
        configure_assistant(draft.loaded.model, k)
    tokenizer = target.loaded.tokenizer
    eos = tokenizer.eos_token_id
    device = target.loaded.model.device
    clock = device_clock(device)
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or threads)
    records: list[PeerRecord] = []
    try:
        progress.set_description("transformers peers")
        for rep in range(repetitions):
            for prompt in range(prompts):
                ids = torch.tensor([encode_chat(tokenizer, chat(PROMPTS[prompt]))], device=device)  # [1, prompt]
                for method in methods if (rep + prompt) % 2 == 0 else list(reversed(methods)):
                    assistant = draft.loaded.model if method == "hf_assisted" and draft is not None else None
                    run = functools.partial(greedy_generate, target.loaded.model, ids, eos=eos, assistant=assistant)
                    first = min(_timed(functools.partial(run, 1), clock)[1] for _ in range(2))  # the faster of two
                    tokens, seconds = _timed(functools.partial(run, max_new_tokens), clock)
                    decode_s = seconds - first
                    ours = reference.get(prompt)
                    records.append(PeerRecord(
                        method=method, prompt=prompt, repetition=rep, completion_tokens=len(tokens), seconds=seconds,
                        first_token_s=first,
                        tokens_per_s=(len(tokens) - 1) / decode_s if decode_s > 0 and len(tokens) > 1 else math.nan,
                        matches_ours=None if ours is None else tokens == ours,
                    ))
                    progress.update()
    finally:
        torch.set_num_threads(threads)
    return records
