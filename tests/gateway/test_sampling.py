"""Sampling through the gateway: seeded reproducibility, exact output distribution, coherence.

The distribution test compares the second generated token — the first one decided by a
speculation round (the first comes from the prefill logits) — against its exact marginal
under the target, P(t2) = sum over t1 of p(t1) p(t2 | t1), computed with `transformers`.
Speculative runs with the int8 draft (mostly accepted) and the 2-layer draft (mostly
rejected: recovered tokens) and plain runs must all fit it.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from specdec.model.chat import encode_chat
from specdec.model.loader import LoadedModel
from specdec.model.runtime import ModelRuntime
from tests.support.chi_square import chi_square_p_value
from tests.support.stacks import Stack, StartStack

PROMPT = [{"role": "user", "content": "Pick a random animal and name it."}]
TOP_K = 4
SAMPLES = 160


@pytest.fixture(scope="module")
def exact_second_token(smollm2: LoadedModel) -> dict[int, float]:
    prompt = encode_chat(smollm2.tokenizer, PROMPT)

    def top_k_probs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = smollm2.model(torch.tensor([ids])).logits[0, -1].float()
        kth = logits.topk(TOP_K).values[-1]
        return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)

    first = top_k_probs(prompt)
    marginal: Counter[int] = Counter()
    for t1 in torch.nonzero(first).flatten().tolist():
        second = top_k_probs(prompt + [t1])
        for t2 in torch.nonzero(second).flatten().tolist():
            marginal[t2] += float(first[t1] * second[t2])
    return dict(marginal)


@pytest.fixture(scope="module")
def bf16_q_stack(start_stack: StartStack, weak_runtime: ModelRuntime) -> Stack:
    """The mostly-rejected 2-layer draft sending q in bf16: exact only if it samples from the rounded q."""
    return start_stack(weak_runtime, draft_probs_dtype="bfloat16")


def _second_tokens(stack: Stack, seeds: range, **options: Any) -> list[int]:
    with stack.client() as client, ThreadPoolExecutor(16) as pool:
        results = pool.map(
            lambda seed: client.generate(PROMPT, max_new_tokens=2, temperature=1.0, top_k=TOP_K, seed=seed, **options),
            seeds,
        )
        return [r.token_ids[1] for r in results]


def _fits(samples: list[int], exact: dict[int, float]) -> float:
    """Chi-square p-value of samples against the exact distribution (rare cells pooled)."""
    counts = Counter(samples)
    assert set(counts) <= set(exact), f"sampled tokens outside the target's support: {set(counts) - set(exact)}"
    n = len(samples)
    common = sorted(t for t, p in exact.items() if p * n >= 5)
    observed = [counts[t] for t in common] + [n - sum(counts[t] for t in common)]
    expected = [exact[t] * n for t in common] + [n - sum(exact[t] * n for t in common)]
    if expected[-1] < 1e-9:
        observed, expected = observed[:-1], expected[:-1]
    return chi_square_p_value(torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize(
    "stack_name, options",
    [
        ("int8_stack", {"num_speculative_tokens": 3}),
        ("weak_stack", {"num_speculative_tokens": 3}),
        ("bf16_q_stack", {"num_speculative_tokens": 3}),
        ("int8_stack", {"speculative": False}),
    ],
    ids=["int8-draft", "2-layer-draft", "2-layer-draft-bf16-q", "plain"],
)
def test_second_token_follows_the_target_distribution(
    stack_name: str, options: dict, exact_second_token: dict[int, float], request: pytest.FixtureRequest
) -> None:
    stack = request.getfixturevalue(stack_name)
    samples = _second_tokens(stack, range(SAMPLES), **options)
    p_value = _fits(samples, exact_second_token)
    assert p_value > 1e-3, (p_value, Counter(samples).most_common(),
                            sorted(exact_second_token.items(), key=lambda kv: -kv[1]))
    stack.wait_until_idle()


@pytest.mark.parametrize("mode", [{"num_speculative_tokens": 4}, {"speculative": False}], ids=["speculative", "plain"])
def test_seeded_requests_reproduce_exactly(int8_stack: Stack, mode: dict) -> None:
    """Plain rounds draw on the target (a seed per position), speculative ones at the gateway."""
    options = dict(max_new_tokens=24, temperature=0.9, top_p=0.95, repetition_penalty=1.1, **mode)
    with int8_stack.client() as client:
        first = client.generate(PROMPT, seed=1234, **options)
        second = client.generate(PROMPT, seed=1234, **options)
        others = [client.generate(PROMPT, seed=s, **options) for s in (1, 2, 3)]
    assert first.token_ids == second.token_ids and first.text == second.text
    assert any(o.token_ids != first.token_ids for o in others)


def test_sampled_text_is_coherent(int8_stack: Stack) -> None:
    with int8_stack.client() as client:
        result = client.generate(
            [{"role": "user", "content": "Describe a sunny day at the beach."}],
            max_new_tokens=48, temperature=0.7, top_p=0.9, seed=7,
        )
    words = result.text.split()
    assert len(words) >= 10
    assert "\ufffd" not in result.text
    letters = sum(ch.isalpha() for ch in result.text)
    assert letters / len(result.text) > 0.6
    common = {"the", "a", "and", "of", "to", "is", "in", "sun", "beach", "sand", "water", "with", "on"}
    assert len(common & {w.strip(".,!").lower() for w in words}) >= 3, result.text
