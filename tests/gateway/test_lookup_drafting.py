"""Lookup drafting through real gRPC: a target and a gateway alone (no draft service), and
lookups beside the model draft, on the whole model (the suite's cut repeats one word, which
every lookup would match). Greedy output equals transformers' token for token in every
method; sampled output keeps the target's distribution (the second token's exact marginal, as
in test_sampling, on a prompt whose answers copy it, so lookups draft most of those rounds)."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from specdec.client import GenerationResult
from specdec.model.chat import encode_chat
from specdec.model.loader import LoadedModel
from specdec.model.runtime import ModelRuntime
from tests.support.marginals import marginal_p_value, second_token_marginal
from tests.support.stacks import Stack, StartStack, chat, generate_all, hf_greedy_of

#: Answers that copy their prompt (lookups match) and one that does not.
PROMPTS = [
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog by the river.",
    "Rename the variable x to total in this function:\ndef add(x, y):\n    x = x + y\n    return x",
    "What is the capital of France?",
]
MAX_NEW_TOKENS = 32
COPY_PROMPT = [{"role": "user", "content": "Repeat after me: red green blue, red green blue."}]
TOP_K = 4
SAMPLES = 160


@pytest.fixture(scope="module")
def lookup_stack(start_module_stack: StartStack, full_fp32_runtime: ModelRuntime) -> Stack:
    """The target and a gateway, no draft service: requests speculate with lookups."""
    return start_module_stack(None, target_runtime=full_fp32_runtime, speculative=True)


@pytest.fixture(scope="module")
def expected(smollm2: LoadedModel) -> list[list[int]]:
    generate = hf_greedy_of(smollm2)
    return [generate(encode_chat(smollm2.tokenizer, chat(p)), MAX_NEW_TOKENS) for p in PROMPTS]


def _run_all(stack: Stack, **options: Any) -> list[GenerationResult]:
    return generate_all(stack, PROMPTS, MAX_NEW_TOKENS, **options)


def test_lookups_without_a_draft_service_keep_the_greedy_output(lookup_stack: Stack, expected: list[list[int]]) -> None:
    with lookup_stack.client() as client:
        info = client.info()
    assert not info.HasField("draft") and info.speculative_enabled
    results = _run_all(lookup_stack, num_speculative_tokens=6)
    for prompt, want, result in zip(PROMPTS, expected, results):
        assert result.token_ids == want, f"lookup drafting diverged from transformers on {prompt!r}"
    assert all(r.num_lookup_draft_tokens == r.num_draft_tokens for r in results)
    # The copying answers were drafted by lookups in good part ("quick brown fox ... river").
    assert results[0].num_lookup_accepted_tokens >= 5, [r.as_dict() for r in results]
    lookup_stack.wait_until_idle()


def test_auto_mixes_lookups_and_the_model_draft_and_keeps_the_greedy_output(
    full_stack: Stack, expected: list[list[int]]
) -> None:
    results = _run_all(full_stack, num_speculative_tokens=4, method="auto")
    for prompt, want, result in zip(PROMPTS, expected, results):
        assert result.token_ids == want, f"auto drafting diverged from transformers on {prompt!r}"
    lookup_rounds = sum(r.num_lookup_rounds for r in results)
    assert 0 < lookup_rounds < sum(r.num_rounds for r in results)  # both sources drafted
    full_stack.wait_until_idle()


@pytest.fixture(scope="module")
def exact_copy_second_token(smollm2: LoadedModel) -> dict[int, float]:
    """P(t2) = Σ_t1 p(t1) p(t2 | t1) of the target with temperature 1 and top-k 4."""
    return second_token_marginal(smollm2.model, encode_chat(smollm2.tokenizer, COPY_PROMPT), TOP_K)


def test_sampled_lookup_rounds_follow_the_target_distribution(
    lookup_stack: Stack, exact_copy_second_token: dict[int, float]
) -> None:
    with lookup_stack.client() as client, ThreadPoolExecutor(16) as pool:
        results = list(pool.map(
            # Three tokens: with two, the round after the first token could emit one and draft none.
            lambda seed: client.generate(COPY_PROMPT, max_new_tokens=3, temperature=1.0, top_k=TOP_K, seed=seed,
                                         method="ngram", num_speculative_tokens=3),
            range(SAMPLES),
        ))
    lookup_rounds = sum(r.num_lookup_rounds for r in results)
    assert lookup_rounds >= SAMPLES // 2, lookup_rounds  # most second tokens were decided by a lookup round
    kept = sum(r.num_lookup_accepted_tokens for r in results)
    assert 0 < kept < sum(r.num_lookup_draft_tokens for r in results)  # both kept and rejected lookup tokens
    samples = [r.token_ids[1] for r in results]
    p_value = marginal_p_value(samples, exact_copy_second_token)
    assert p_value > 1e-3, (p_value, Counter(samples).most_common(),
                            sorted(exact_copy_second_token.items(), key=lambda kv: -kv[1]))
    lookup_stack.wait_until_idle()
