"""Our paged-KV Llama forward must match `transformers`' own forward on the same weights.

Two families of models: random-initialised configs that mirror Llama-3.2-1B and -3B
(only the layer count and MLP width shrunk; real vocab, head dims, GQA, llama3 RoPE
scaling and tied embeddings kept), prompted with the real Llama-3.2 tokenizer; and the
real SmolLM2-135M weights. Each is checked for a batched prefill of prompts of different
lengths, a verify chunk after a rollback, and step-by-step decoding.

The random models are device-agnostic: on `--device`, in fp32 to `TOLERANCE` and in bf16
within `BF16_SLACK` times transformers' own bf16 error (bf16 is not bit-stable across kernels).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
from collections.abc import Iterator

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedModel
from transformers.initialization import no_init_weights

from specdec.model.llama import PagedLlama
from specdec.model.loader import LoadedModel, load_tokenizer
from specdec.model.random_models import ARCHITECTURES

TOLERANCE = 1e-4
#: In bf16 our logits may be at most this many times as far from the fp32 logits (max abs
#: difference) as transformers' own bf16 forward of the same weights is: both round every
#: op's output to bf16 (8 mantissa bits, so an ulp of 0.25 at a logit of 32), in different
#: orders and kernels, and a fixed tolerance would fit one device's kernels only.
BF16_SLACK = 2.0
PROMPTS = [
    "The quick brown fox jumps over the lazy dog because",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Translate to French: I would like a cup of coffee, please.",
    "1, 2, 3, 5, 8, 13,",
]
# Llama-3.2-1B and -3B as published (`specdec.model.random_models`), except two layers and a
# 512-wide MLP.
MIRRORED_CONFIGS = ("llama-3.2-1b", "llama-3.2-3b")


@functools.cache  # ~1-1.6 GB each: built once, let go when the module ends (`_release_models`)
def _mirrored_llama(name: str, device: torch.device) -> PreTrainedModel:
    """The mirrored config `name` with its random weights, in fp32 on `device`."""
    return _random_llama(name).to(device)


@pytest.fixture(scope="module", autouse=True)
def _release_models() -> Iterator[None]:
    """The worker that ran this module keeps running others: it holds none of its gigabytes."""
    yield
    _mirrored_llama.cache_clear()
    _fp32_references.cache_clear()
    gc.collect()


def _random_llama(name: str) -> PreTrainedModel:
    config = dataclasses.replace(ARCHITECTURES[name], intermediate_size=512).config(num_layers=2)
    with no_init_weights():  # transformers' init draws ~700M random numbers: 15 s of a 2-core test
        model = LlamaForCausalLM(config).eval()
    model.tie_weights()  # init_weights, skipped above, is where transformers ties the head
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # Weights are windows of one pool of 2**20 + 7 normal draws, each parameter at its own
    # offset: no two rows of a matrix are equal and it takes well under a second. Std 0.02
    # as transformers draws them, but 0.1 for the (tied) embedding: that gives a real model's
    # logit range (|logit| up to ~20), where fp32 rounding is still well below the 1e-4 tolerance.
    pool = torch.randn(2**20 + 7, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for index, (name, param) in enumerate(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            count = param.numel()
            reps = -(-(count + index) // pool.numel())
            std = 0.1 if name == "model.embed_tokens.weight" else 0.02
            param.copy_(pool.repeat(reps)[index : index + count].view_as(param) * std)
    return model


def _reference_logits(model: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([tokens], device=model.device)).logits[0].float()  # [len, vocab]
    assert logits.abs().max() > 5, "logits too small for the tolerance to mean anything"
    return logits


def _check_parity(model: PreTrainedModel, prompts: list[list[int]], generated: list[list[int]], *,
                  refs: list[torch.Tensor] | None = None, atol: float = TOLERANCE) -> None:
    """prompt prefill (batched), verify chunk after rollback (batched), decode step by step:
    each within `atol` of the reference logits `refs` of each prompt + continuation
    (transformers' forward of `model` itself, unless given)."""
    runner = PagedLlama(model)
    cache = runner.new_cache(token_budget=1024, block_size=16)
    full = [p + g for p, g in zip(prompts, generated)]
    if refs is None:
        refs = [_reference_logits(model, seq) for seq in full]
    slots = [f"r{i}" for i in range(len(full))]
    for slot in slots:
        cache.blocks.allocate(slot)

    # 1. One batched prefill over prompts of different lengths, logits at every position.
    out = runner.run(cache, list(zip(slots, prompts)), logits="all")
    for got, ref, prompt in zip(out, refs, prompts):
        torch.testing.assert_close(got.float(), ref[: len(prompt)], atol=atol, rtol=0)

    # 2. Feed 3 wrong tokens, roll back, then verify the real 4-token continuation in one chunk.
    junk = [[7, 8, 9]] * len(full)
    runner.run(cache, list(zip(slots, junk)), logits="all")
    for slot, prompt in zip(slots, prompts):
        cache.blocks.truncate_to(slot, len(prompt))
    out = runner.run(cache, [(s, g[:4]) for s, g in zip(slots, generated)], logits="all")
    for got, ref, prompt in zip(out, refs, prompts):
        torch.testing.assert_close(got.float(), ref[len(prompt) : len(prompt) + 4], atol=atol, rtol=0)

    # 3. Decode the rest one token per request per step, all requests batched.
    for step in range(4, len(generated[0])):
        out = runner.run(cache, [(s, [g[step]]) for s, g in zip(slots, generated)], logits="last")
        for got, ref, prompt in zip(out, refs, prompts):
            torch.testing.assert_close(got.float(), ref[len(prompt) + step], atol=atol, rtol=0)

    for slot in slots:
        cache.blocks.free(slot)
    assert cache.blocks.num_free_blocks == cache.blocks.num_blocks


@functools.cache  # the same case for every test (the tokenizer takes seconds to load)
def _llama32_case() -> tuple[list[list[int]], list[list[int]]]:
    """The prompts in the real Llama-3.2 tokenizer, and 8 random continuation tokens each."""
    tokenizer = load_tokenizer("llama-3.2")
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    assert len({len(p) for p in prompts}) > 1, "prompts must differ in length"
    generator = torch.Generator().manual_seed(1)
    generated = [torch.randint(0, 128_000, (8,), generator=generator).tolist() for _ in prompts]
    return prompts, generated


@functools.cache  # both tests of a config compare with them: one forward each per session
def _fp32_references(name: str, device: torch.device) -> list[torch.Tensor]:
    """transformers' fp32 logits of the mirrored config `name` over each prompt + continuation
    of `_llama32_case`."""
    prompts, generated = _llama32_case()
    return [_reference_logits(_mirrored_llama(name, device), p + g) for p, g in zip(prompts, generated)]


@pytest.mark.device_agnostic
@pytest.mark.parametrize("name", MIRRORED_CONFIGS)
def test_mirrored_llama32_configs_match_transformers(name: str, device: torch.device) -> None:
    _check_parity(_mirrored_llama(name, device), *_llama32_case(), refs=_fp32_references(name, device))


@pytest.mark.device_agnostic
@pytest.mark.parametrize("name", MIRRORED_CONFIGS)
def test_mirrored_llama32_configs_in_bf16_stay_as_close_to_fp32_as_transformers(name: str,
                                                                               device: torch.device) -> None:
    bf16 = copy.deepcopy(_mirrored_llama(name, device)).to(torch.bfloat16)
    prompts, generated = _llama32_case()
    full = [p + g for p, g in zip(prompts, generated)]
    fp32_refs = _fp32_references(name, device)
    theirs = max(float((_reference_logits(bf16, seq) - ref).abs().max()) for seq, ref in zip(full, fp32_refs))
    assert 0 < theirs < 1, f"transformers' own bf16 error {theirs} is no yardstick"
    _check_parity(bf16, prompts, generated, refs=fp32_refs, atol=BF16_SLACK * theirs)


@pytest.mark.device_agnostic
def test_llama3_rope_scaling_is_active(device: torch.device) -> None:
    """Guard against silently testing plain RoPE: llama3 scaling changes low frequencies."""
    model = _mirrored_llama("llama-3.2-1b", device)
    runner = PagedLlama(model)
    base = 1.0 / (500000.0 ** (torch.arange(0, 64, 2).float() / 64))
    assert not torch.allclose(runner.inv_freq.float().cpu(), base)
    assert torch.allclose(runner.inv_freq.float().cpu()[:4], base[:4])  # high frequencies untouched


def test_smollm2_real_weights_match_transformers(smollm2: LoadedModel) -> None:
    """The whole model, all 30 layers, against `transformers`' forward."""
    tokenizer = smollm2.tokenizer
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    generator = torch.Generator().manual_seed(2)
    vocab = smollm2.model.config.vocab_size
    generated = [torch.randint(0, vocab, (8,), generator=generator).tolist() for _ in prompts]
    _check_parity(smollm2.model, prompts, generated)


def test_batch_composition_does_not_change_results(target_model: LoadedModel) -> None:
    """A request's logits are the same alone or batched with others of other lengths."""
    runner = PagedLlama(target_model.model)
    tokenizer = target_model.tokenizer
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    alone_cache = runner.new_cache(token_budget=512)
    alone_cache.blocks.allocate("x")
    alone = runner.run(alone_cache, [("x", prompts[1])])[0]
    batch_cache = runner.new_cache(token_budget=512)
    for i in range(len(prompts)):
        batch_cache.blocks.allocate(f"r{i}")
    batched = runner.run(batch_cache, [(f"r{i}", p) for i, p in enumerate(prompts)])[1]
    torch.testing.assert_close(batched, alone, atol=TOLERANCE, rtol=0)


def test_unsupported_architecture_is_rejected() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from specdec.errors import InvalidArgumentError

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(InvalidArgumentError, match="gpt2"):
        PagedLlama(model)
