"""Sampling through the gateway: seeded reproducibility, exact output distribution, coherence.

The distribution test compares the second generated token — the first one decided by a
speculation round (the first comes from the prefill logits) — against its exact marginal
under the target, P(t2) = sum over t1 of p(t1) p(t2 | t1), computed with `transformers`.
Speculative runs under rejection sampling with the int8 draft (mostly accepted) and the
2-layer draft (mostly rejected: recovered tokens), and plain runs must all fit it. A seeded
request under drawn verification (the default for seeded ones) emits plain decoding's tokens
exactly, whatever it drafts with: it then follows plain decoding's distribution too.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from specdec.model.chat import encode_chat
from specdec.model.loader import LoadedModel
from specdec.model.runtime import ModelRuntime
from tests.support.marginals import marginal_p_value, second_token_marginal
from tests.support.stacks import Stack, StartStack

PROMPT = [{"role": "user", "content": "Pick a random animal and name it."}]
TOP_K = 4
SAMPLES = 160


@pytest.fixture(scope="module")
def exact_second_token(target_model: LoadedModel) -> dict[int, float]:
    return second_token_marginal(target_model.model, encode_chat(target_model.tokenizer, PROMPT), TOP_K)


@pytest.fixture(scope="module")
def bf16_q_stack(start_module_stack: StartStack, weak_runtime: ModelRuntime) -> Stack:
    """The mostly-rejected 2-layer draft sending q in bf16: exact only if it samples from the rounded q."""
    return start_module_stack(weak_runtime, draft_probs_dtype="bfloat16")


def _second_tokens(stack: Stack, seeds: range, **options: Any) -> tuple[list[int], int]:
    """Each seed's second token and the draft tokens proposed over all requests. Three new tokens:
    the round after the first token then has room to draft one, so the second token is decided
    by a speculation round (with two, that round is plain)."""
    with stack.client() as client, ThreadPoolExecutor(16) as pool:
        results = list(pool.map(
            lambda seed: client.generate(PROMPT, max_new_tokens=3, temperature=1.0, top_k=TOP_K, seed=seed, **options),
            seeds,
        ))
    return [r.token_ids[1] for r in results], sum(r.num_draft_tokens for r in results)


@pytest.mark.parametrize(
    "stack_name, options",
    [
        ("int8_stack", {"num_speculative_tokens": 3, "verification": "rejection"}),
        ("weak_stack", {"num_speculative_tokens": 3, "verification": "rejection"}),
        ("bf16_q_stack", {"num_speculative_tokens": 3, "verification": "rejection"}),
        ("int8_stack", {"speculative": False}),
    ],
    ids=["int8-draft", "2-layer-draft", "2-layer-draft-bf16-q", "plain"],
)
def test_second_token_follows_the_target_distribution(
    stack_name: str, options: dict, exact_second_token: dict[int, float], request: pytest.FixtureRequest
) -> None:
    stack = request.getfixturevalue(stack_name)
    samples, drafted = _second_tokens(stack, range(SAMPLES), **options)
    assert (drafted > 0) == options.get("speculative", True)
    p_value = marginal_p_value(samples, exact_second_token)
    assert p_value > 1e-3, (p_value, Counter(samples).most_common(),
                            sorted(exact_second_token.items(), key=lambda kv: -kv[1]))
    stack.wait_until_idle()


@pytest.mark.parametrize("mode", [{"num_speculative_tokens": 4}, {"speculative": False}], ids=["speculative", "plain"])
def test_seeded_requests_reproduce_exactly(int8_stack: Stack, mode: dict) -> None:
    """Plain rounds draw on the target (a seed per position), speculative ones at the gateway;
    every transform is on, the output penalties' counts growing inside each verify."""
    options = dict(max_new_tokens=24, temperature=0.9, top_p=0.95, repetition_penalty=1.1, min_p=0.02,
                   presence_penalty=0.5, frequency_penalty=0.3, logit_bias={28: 2.0, 30: -5.0}, **mode)
    with int8_stack.client() as client:
        first = client.generate(PROMPT, seed=1234, **options)
        second = client.generate(PROMPT, seed=1234, **options)
        with ThreadPoolExecutor(3) as pool:  # only compared with the first: sent together, they share rounds
            others = list(pool.map(lambda s: client.generate(PROMPT, seed=s, **options), (1, 2, 3)))
    assert first.token_ids == second.token_ids and first.text == second.text
    assert any(o.token_ids != first.token_ids for o in others)


@pytest.mark.parametrize(
    "options",
    [{"num_speculative_tokens": 4}, {"num_speculative_tokens": 2, "verification": "drawn"}, {"method": "ngram"},
     {"method": "auto"}],
    ids=["model-k4", "model-k2", "ngram", "auto"],
)
def test_seeded_requests_emit_plain_decodings_tokens(int8_stack: Stack, options: dict) -> None:
    """Drawn verification: the draft tokens kept are the target's own draws, so the tokens are
    plain decoding's for the seed (penalty context growing inside the verify included)."""
    sampling = dict(max_new_tokens=24, temperature=0.9, top_p=0.95, repetition_penalty=1.1)
    echo = "Repeat after me: the cat sat on the mat, the cat sat on the mat."
    prompts = [PROMPT, [{"role": "user", "content": echo}]]
    drafted = 0
    with int8_stack.client() as client:
        for prompt in prompts:
            plain = client.generate(prompt, seed=99, speculative=False, **sampling)
            speculative = client.generate(prompt, seed=99, **sampling, **options)
            assert speculative.token_ids == plain.token_ids, (speculative.text, plain.text)
            drafted += speculative.num_draft_tokens
    assert drafted > 0


def test_sampled_text_is_coherent(full_stack: Stack) -> None:
    with full_stack.client() as client:
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
