"""Admission under pressure on the real stack: requests asking for 10**9 tokens hold only the
KV they use, so short requests keep flowing beside them, and nothing leaks.

The pools hold 128 tokens (8 blocks), so two long counting generations can fill them:
before on-demand allocation the first one reserved the whole pool up front, and every
request behind it waited for both to finish.
"""

from __future__ import annotations

import threading

import pytest

from specdec.client import GenerationResult
from specdec.model.runtime import ModelRuntime
from tests.support.services import eventually, slow_down
from tests.support.stacks import StartStack

COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # greedy keeps counting: no early EOS
SHORT = ["The capital of France is", "Water boils at", "The opposite of hot is"]
SMALL_POOL = dict(kv_token_budget=128)


def test_huge_requests_do_not_starve_short_ones_and_nothing_leaks(
    start_stack: StartStack, int8_runtime: ModelRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = start_stack(int8_runtime, target=SMALL_POOL, draft=SMALL_POOL, num_speculative_tokens=2)
    with stack.client() as client:
        references = {prompt: client.generate(prompt, max_new_tokens=8, speculative=False).token_ids
                      for prompt in SHORT}
        # Rounds of at least 50 ms: the huge requests' ~40 rounds outlast the short ones' few (and
        # the client's pauses between them) on any machine.
        slow_down(monkeypatch, stack.target, "verify", 0.05)
        huge_done = [threading.Event() for _ in range(2)]
        huge_results: list[GenerationResult | None] = [None, None]

        def run_huge(i: int) -> None:
            try:
                huge_results[i] = client.generate(COUNTING, max_new_tokens=10**9)
            finally:
                huge_done[i].set()

        threads = [threading.Thread(target=run_huge, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        # Both huge requests hold slots before the short ones arrive.
        assert eventually(lambda: len(stack.target.tokens) >= 2), "the huge requests were never admitted"
        for prompt in SHORT:
            result = client.generate(prompt, max_new_tokens=8)
            assert result.token_ids == references[prompt]
            assert not all(done.is_set() for done in huge_done), "a short request waited for the huge ones"
        for thread in threads:
            thread.join(timeout=120)
    for huge in huge_results:
        assert huge is not None and huge.finish_reason == "length"
        assert huge.prompt_tokens + huge.completion_tokens == 128
    stack.wait_until_idle()
    for engine in stack.engines():
        assert engine.cache.blocks.free_tokens == engine.cache.capacity_tokens
