"""Greedy exactness: speculative == non-speculative == transformers generate, token for token.

Checked with the int8 draft (mostly accepted) and with a first-2-layer draft (mostly
rejected), so both the accept and the recover paths are exercised. The five prompts run
concurrently, so the batched rounds are under test too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
)

from specdec.client import GenerationResult
from specdec.model.chat import encode_chat
from specdec.model.loader import LoadedModel
from tests.support.stacks import Stack, chat, generate_all

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "List three colours of the rainbow.",
    "Translate 'good morning' into Spanish and German.",
    "Why do cats purr? Answer in one sentence.",
]
MAX_NEW_TOKENS = 32
#: Enough for the penalties to bite (words repeat), short for the mostly rejected draft.
BIAS_NEW_TOKENS = 20


@pytest.fixture(scope="module")
def expected(target_model: LoadedModel, hf_greedy: Callable[[list[int], int], list[int]]) -> list[list[int]]:
    return [hf_greedy(encode_chat(target_model.tokenizer, chat(p)), MAX_NEW_TOKENS) for p in PROMPTS]


def _run_all(stack: Stack, **options: Any) -> list[GenerationResult]:
    return generate_all(stack, PROMPTS, MAX_NEW_TOKENS, **options)


@pytest.mark.parametrize("stack_name", ["int8_stack", "weak_stack"])
def test_speculative_equals_plain_equals_transformers(
    stack_name: str, expected: list[list[int]], request: pytest.FixtureRequest
) -> None:
    stack = request.getfixturevalue(stack_name)
    speculative = _run_all(stack, num_speculative_tokens=4)
    plain = _run_all(stack, speculative=False)
    for prompt, want, spec, base in zip(PROMPTS, expected, speculative, plain):
        assert base.token_ids == want, f"plain decoding diverged from transformers on {prompt!r}"
        assert spec.token_ids == want, f"speculative decoding diverged from transformers on {prompt!r}"
        assert spec.text == base.text
        assert spec.finish_reason == ("length" if len(want) == MAX_NEW_TOKENS else "stop")
    rates = [r.acceptance_rate for r in speculative]
    if stack_name == "int8_stack":
        assert sum(rates) / len(rates) > 0.5, rates  # the quantized self-draft mostly agrees
    else:
        assert sum(rates) / len(rates) < 0.5, rates  # the 2-layer draft is mostly rejected
    assert all(r.acceptance_rate == 0.0 and r.mean_acceptance_length == 0.0 for r in plain)
    stack.wait_until_idle()


def test_num_speculative_tokens_per_request_keeps_exactness(int8_stack: Stack, expected: list[list[int]]) -> None:
    with int8_stack.client() as client:
        for k in (1, 7):
            result = client.generate(chat(PROMPTS[0]), max_new_tokens=MAX_NEW_TOKENS, num_speculative_tokens=k)
            assert result.token_ids == expected[0], f"K={k}"


class _LogitBias(LogitsProcessor):
    """OpenAI's logit bias: added to the raw logits."""

    def __init__(self, bias: dict[int, float]) -> None:
        self.bias = bias

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for token, bias in self.bias.items():
            scores[:, token] += bias
        return scores


class _OutputPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the tokens after the prompt:
    logit -= presence * (count > 0) + frequency * count."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        output = input_ids[:, self.prompt_len :]  # [1, generated]
        counts = torch.zeros_like(scores).scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
        return scores - (self.presence * (counts > 0) + self.frequency * counts)


def test_logit_bias_and_penalties_keep_greedy_exactness(weak_stack: Stack, target_model: LoadedModel) -> None:
    """Greedy with a logit bias, the repetition penalty and presence / frequency penalties:
    speculative == plain == transformers generate with the same processors. The 2-layer
    draft is mostly rejected, so the gateway recovers from the adjusted logits often."""
    stack = weak_stack
    tokenizer = target_model.tokenizer
    banned = tokenizer.convert_tokens_to_ids("The")
    bias = {banned: -100.0, tokenizer.convert_tokens_to_ids("Ġthe"): -3.0,
            tokenizer.convert_tokens_to_ids("Ġcapital"): 2.0}
    options = dict(logit_bias=bias, repetition_penalty=1.1, presence_penalty=0.6, frequency_penalty=0.4)
    prompts = PROMPTS[:2]
    speculative = generate_all(stack, prompts, BIAS_NEW_TOKENS, num_speculative_tokens=4, **options)
    plain = generate_all(stack, prompts, BIAS_NEW_TOKENS, speculative=False, **options)
    for prompt, spec, base in zip(prompts, speculative, plain):
        ids = encode_chat(tokenizer, chat(prompt))
        processors = LogitsProcessorList([_LogitBias(bias), RepetitionPenaltyLogitsProcessor(1.1),
                                          _OutputPenalties(len(ids), presence=0.6, frequency=0.4)])
        with torch.inference_mode():
            out = target_model.model.generate(torch.tensor([ids]), max_new_tokens=BIAS_NEW_TOKENS, do_sample=False,
                                         logits_processor=processors, attention_mask=torch.ones(1, len(ids)),
                                         pad_token_id=tokenizer.eos_token_id)
        want = out[0, len(ids):].tolist()
        want = want[: want.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in want else want
        assert base.token_ids == want, f"plain decoding diverged from transformers on {prompt!r}"
        assert spec.token_ids == want, f"speculative decoding diverged from transformers on {prompt!r}"
        assert banned not in want  # the bias took effect
    assert sum(r.num_draft_tokens for r in speculative) > 0
    stack.wait_until_idle()
