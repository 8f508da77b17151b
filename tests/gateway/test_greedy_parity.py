"""Greedy exactness: speculative == non-speculative == transformers generate, token for token.

Checked with the int8 draft (mostly accepted) and with a first-2-layer draft (mostly
rejected), so both the accept and the recover paths are exercised. The five prompts run
concurrently, so the batched rounds are under test too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

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


@pytest.fixture(scope="module")
def expected(smollm2: LoadedModel, hf_greedy: Callable[[list[int], int], list[int]]) -> list[list[int]]:
    return [hf_greedy(encode_chat(smollm2.tokenizer, chat(p)), MAX_NEW_TOKENS) for p in PROMPTS]


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
