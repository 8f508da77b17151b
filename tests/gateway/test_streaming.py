"""Streaming behaviour: multi-token messages, concurrency, stop rules, length limits, cancellation."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from specdec.client import build_request, collect
from specdec.model.loader import LoadedModel
from specdec.model.runtime import ModelRuntime
from tests.support.services import slow_down
from tests.support.stacks import DRAFT_COSTS, TARGET_COSTS, HfGreedy, Stack, StartStack, chat

STORY = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]
QUESTIONS = [
    "What is 2 + 2?", "Name a planet.", "Say hello in French.", "What colour is the sky?",
    "Give me a synonym for happy.", "What is the opposite of cold?", "Name a fruit.", "Count to five.",
    "What is water made of?", "Name a musical instrument.",
]


def test_a_round_with_several_accepted_tokens_arrives_as_one_message(int8_stack: Stack) -> None:
    with int8_stack.client() as client:
        result = client.generate(STORY, max_new_tokens=40, num_speculative_tokens=4)
    assert max(len(chunk) for chunk in result.chunks) > 1, result.chunks
    assert sum(len(chunk) for chunk in result.chunks) == len(result.token_ids) == result.completion_tokens
    assert result.mean_acceptance_length > 1.0


def test_concurrent_streams_match_each_request_alone(int8_stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    batch_sizes: list[int] = []
    verify = int8_stack.target.verify

    def counting_verify(items: list[Any], *rest: Any) -> object:
        batch_sizes.append(len(items))
        return verify(items, *rest)

    with int8_stack.client() as client:
        alone = [client.generate(chat(q), max_new_tokens=16) for q in QUESTIONS]
        monkeypatch.setattr(int8_stack.target, "verify", counting_verify)
        # Every Prefill takes a second more: the requests arriving meanwhile are admitted before
        # the first round (tests/unit/gateway), so they share a Verify however fast the machine.
        slow_down(monkeypatch, int8_stack.target, "prefill", 1.0)
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            together = list(pool.map(lambda q: client.generate(chat(q), max_new_tokens=16), QUESTIONS))
    assert max(batch_sizes) > 1, "the concurrent requests were never verified in one batch"
    for question, a, b in zip(QUESTIONS, alone, together):
        assert b.finish_reason in ("stop", "length")
        assert b.token_ids == a.token_ids, question
    int8_stack.wait_until_idle()


def test_max_new_tokens_is_exact(int8_stack: Stack) -> None:
    with int8_stack.client() as client:
        for n in (1, 2, 5, 13):
            result = client.generate(STORY, max_new_tokens=n, num_speculative_tokens=4)
            assert result.finish_reason == "length"
            assert len(result.token_ids) == result.completion_tokens == n


def test_stop_string_across_a_token_boundary(full_stack: Stack, smollm2: LoadedModel) -> None:
    """On the whole model, whose text has words of two characters and more."""
    tokenizer = smollm2.tokenizer
    with full_stack.client() as client:
        free = client.generate(STORY, max_new_tokens=40)
        # A stop string made of the end of one token and the start of the next.
        pieces = [tokenizer.decode([t]) for t in free.token_ids]
        index = next(i for i in range(5, len(pieces) - 1)
                     if len(pieces[i].strip()) >= 2 and len(pieces[i + 1].strip()) >= 2)
        prefix = "".join(pieces[:index])
        stop = pieces[index][-2:] + pieces[index + 1][:2]
        assert stop not in prefix + pieces[index][:-2]  # its first occurrence straddles the boundary
        result = client.generate(STORY, max_new_tokens=40, stop=[stop])
    assert result.finish_reason == "stop"
    cut = free.text.index(stop)
    assert result.text == free.text[:cut]
    assert stop not in result.text
    assert result.token_ids == free.token_ids[: index + 2]  # tokens after the one completing it are dropped


def test_stop_string_with_plain_decoding(int8_stack: Stack) -> None:
    with int8_stack.client() as client:
        free = client.generate(STORY, max_new_tokens=30, speculative=False)
        word = free.text.split()[3]
        result = client.generate(STORY, max_new_tokens=30, speculative=False, stop=[word])
    assert result.finish_reason == "stop"
    assert result.text == free.text[: free.text.index(word)]


def test_max_sequence_length_edge(
    start_stack: StartStack, int8_runtime: ModelRuntime, hf_greedy: HfGreedy, target_model: LoadedModel
) -> None:
    """Near max_seq_len K shrinks so K+1 fits, then falls back to K=0; output stays exact."""
    from specdec.model.chat import encode_chat

    prompt_ids = encode_chat(target_model.tokenizer, STORY)
    limit = len(prompt_ids) + 7
    stack = start_stack(int8_runtime, target=dict(max_seq_len=limit), draft=dict(max_seq_len=limit))
    with stack.client() as client:
        result = client.generate(STORY, max_new_tokens=50, num_speculative_tokens=4)
        assert result.finish_reason == "length"
        assert result.prompt_tokens + result.completion_tokens == limit
        assert result.token_ids == hf_greedy(prompt_ids, 7)
        with pytest.raises(grpc.RpcError) as error:
            client.generate([{"role": "user", "content": "word " * 200}], max_new_tokens=5)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_seq_len" in error.value.details()
    stack.wait_until_idle()


def test_cancelled_stream_frees_its_slots_in_both_services(int8_stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    slow_down(monkeypatch, int8_stack.target, "verify", 0.05)  # 400 tokens take seconds: still running at the cancel
    with int8_stack.client() as client:
        call = client.stub.Generate(build_request(STORY, max_new_tokens=400), timeout=120)
        received = 0
        for response in call:
            received += len(response.token_ids)
            if received >= 3:
                break
        assert all(engine.tokens for engine in int8_stack.engines()), "both services should hold the slot"
        call.cancel()
    int8_stack.wait_until_idle()
    for engine in int8_stack.engines():
        assert engine.cache.blocks.num_free_blocks == engine.cache.blocks.num_blocks


def test_deadline_exceeded_frees_slots(int8_stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    # At least 0.2 s a round: 400 tokens (at most 9 a round) take over 8 s, so the 1.5-s
    # deadline passes mid-stream on any machine.
    slow_down(monkeypatch, int8_stack.target, "verify", 0.2)
    with int8_stack.client() as client:
        with pytest.raises(grpc.RpcError) as error:
            collect(client.stub.Generate(build_request(STORY, max_new_tokens=400), timeout=1.5))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    int8_stack.wait_until_idle()


def test_adaptive_k_turns_a_weak_draft_off_and_stays_exact(
    start_stack: StartStack, weak_runtime: ModelRuntime, weak_stack: Stack
) -> None:
    """With cost tables, the planner stops drafting for a draft that is almost never accepted.

    The costs are pinned, not timed: the draft at a quarter of the target, so drafting pays
    only while α > ~0.3 (K = 1 yields 1 + α tokens for 1.3 target steps). It starts from the
    prior α = 0.8; this draft's is ~0.02, which no plausible cost ratio (the online scales
    correct the tables towards this machine's) makes pay."""
    adaptive_stack = start_stack(weak_runtime, adaptive_k=True, target_costs=TARGET_COSTS, draft_costs=DRAFT_COSTS)
    with adaptive_stack.client() as client:
        assert client.info().adaptive_k
        adaptive = client.generate(chat(QUESTIONS[0]), max_new_tokens=48)
    with weak_stack.client() as client:
        fixed = client.generate(chat(QUESTIONS[0]), max_new_tokens=48, num_speculative_tokens=4)
        plain = client.generate(chat(QUESTIONS[0]), max_new_tokens=48, speculative=False)
    assert adaptive.token_ids == fixed.token_ids == plain.token_ids
    assert adaptive.num_draft_tokens < fixed.num_draft_tokens / 2
    # The final message counts the rounds that drafted nothing: all of them when plain, the
    # turned-off ones with adaptive K (a round decodes at least one of the 47 tokens after the first).
    assert plain.num_rounds == 0 and 1 <= plain.num_plain_rounds <= 47
    assert adaptive.num_plain_rounds > 0 and adaptive.num_rounds + adaptive.num_plain_rounds <= 47
    adaptive_stack.wait_until_idle()
