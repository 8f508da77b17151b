"""The start-up cost profile on a tiny random Llama: which points it times, and that it leaves
the pool as it found it."""

from __future__ import annotations

import pytest

from specdec.model.llama import PagedLlama
from specdec.tuning.cost_profile import (
    CHUNK_WIDTHS,
    CONTEXT_LEN,
    LONG_CONTEXT_LEN,
    LONGEST_CONTEXT_LEN,
    PREFILL_WIDTH,
    forward_cost_steps,
    measure_forward_costs,
    step_seconds,
)
from tests.support.tiny_models import tiny_llama


def test_profile_times_verify_chunks_and_a_prompt_sized_prefill() -> None:
    forward = PagedLlama(tiny_llama())
    cache = forward.new_cache(token_budget=4096, block_size=16)
    costs = measure_forward_costs(forward, cache, max_batch=4, max_tokens=9, repeats=1)

    points = {(c.batch_size, c.tokens) for c in costs if c.context == CONTEXT_LEN}
    assert {(1, t) for t in CHUNK_WIDTHS if t <= 9} <= points
    assert {(4, t) for t in CHUNK_WIDTHS if t <= 9} <= points
    # A catch-up or prefill is interpolated from a measured prompt-sized chunk, not extrapolated.
    assert (1, PREFILL_WIDTH) in points and PREFILL_WIDTH > max(CHUNK_WIDTHS)
    # The narrowest and widest chunk of each batch size again at a long context (no room for
    # the longest one in this pool).
    long = {(c.batch_size, c.tokens) for c in costs if c.context == LONG_CONTEXT_LEN}
    assert long == {(1, 1), (1, 9), (4, 1), (4, 9)}
    assert LONGEST_CONTEXT_LEN not in {c.context for c in costs}
    assert all(c.seconds > 0 for c in costs)
    assert cache.blocks.free_tokens == cache.capacity_tokens  # the profile's slots are gone


def test_a_pool_with_room_times_one_request_at_the_longest_context_too() -> None:
    forward = PagedLlama(tiny_llama())
    cache = forward.new_cache(token_budget=8192, block_size=16)
    costs = measure_forward_costs(forward, cache, max_batch=4, max_tokens=9, repeats=1)
    assert {(c.batch_size, c.tokens) for c in costs if c.context == LONGEST_CONTEXT_LEN} == {(1, 1), (1, 9)}
    assert cache.blocks.free_tokens == cache.capacity_tokens


def test_the_widest_verify_is_timed_where_the_batch_stays_within_the_row_limit() -> None:
    forward = PagedLlama(tiny_llama())
    cache = forward.new_cache(token_budget=8192, block_size=16)
    costs = measure_forward_costs(forward, cache, max_batch=16, max_tokens=17, repeats=1)
    points = {(c.batch_size, c.tokens, c.context) for c in costs}
    assert (1, 17, CONTEXT_LEN) in points and (4, 17, CONTEXT_LEN) in points
    # A K = 8 verify of 16 requests is timed, not extrapolated from the 3-token point...
    assert {(16, t, CONTEXT_LEN) for t in (1, 2, 3, 5, 9)} <= points
    assert (16, 17, CONTEXT_LEN) not in points  # ...but 16 × 17 rows > MAX_ROWS


def test_the_profile_steps_one_forward_at_a_time_and_a_spot_check_times_the_step() -> None:
    forward = PagedLlama(tiny_llama())
    cache = forward.new_cache(token_budget=4096, block_size=16)
    steps = forward_cost_steps(forward, cache, max_batch=4, max_tokens=5, repeats=1)
    next(steps)
    assert cache.blocks.free_tokens < cache.capacity_tokens  # the profile's slots live between steps
    taken = 1
    with pytest.raises(StopIteration) as ended:
        while True:
            next(steps)
            taken += 1
    costs = ended.value.value
    assert taken == 2 * len(costs)  # a warm-up pass and a timed one, a forward a step
    assert cache.blocks.free_tokens == cache.capacity_tokens
    seconds = step_seconds(forward, cache, repeats=1)
    assert seconds is not None and seconds > 0
    assert cache.blocks.free_tokens == cache.capacity_tokens
    assert step_seconds(forward, forward.new_cache(token_budget=64, block_size=16)) is None  # no room


def test_a_profile_closed_half_way_frees_its_slots() -> None:
    forward = PagedLlama(tiny_llama())
    cache = forward.new_cache(token_budget=4096, block_size=16)
    steps = forward_cost_steps(forward, cache, max_batch=4, max_tokens=5, repeats=1)
    next(steps)
    steps.close()
    assert cache.blocks.free_tokens == cache.capacity_tokens


def test_profile_skips_batches_that_would_take_more_than_half_the_pool() -> None:
    forward = PagedLlama(tiny_llama())
    cache = forward.new_cache(token_budget=512, block_size=16)
    costs = measure_forward_costs(forward, cache, max_batch=16, max_tokens=9, repeats=1)
    assert {c.batch_size for c in costs} == {1}
    assert {c.context for c in costs} == {CONTEXT_LEN}  # no room for a long context either


def test_a_small_pool_skips_the_prefill_point_and_a_tiny_one_skips_the_profile() -> None:
    forward = PagedLlama(tiny_llama())
    small = forward.new_cache(token_budget=256, block_size=16)  # 128 tokens to profile with
    costs = measure_forward_costs(forward, small, max_batch=4, max_tokens=5, repeats=1)
    points = {(c.batch_size, c.tokens) for c in costs}
    assert points == {(1, t) for t in CHUNK_WIDTHS if t <= 5}
    tiny = forward.new_cache(token_budget=64, block_size=16)
    assert measure_forward_costs(forward, tiny, max_batch=4, max_tokens=5, repeats=1) == []
    assert tiny.blocks.free_tokens == tiny.capacity_tokens
