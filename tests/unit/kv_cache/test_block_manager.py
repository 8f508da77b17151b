"""Tests for the paged KV block manager: unit tests per method and error, plus a stateful
hypothesis test against a reference model (slot -> length). Pure bookkeeping: it runs the same
whatever `--device` is (marked device_agnostic so that the device run includes it)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from specdec.errors import (
    CapacityExhaustedError,
    InvalidArgumentError,
    SlotExistsError,
    SlotNotFoundError,
)
from specdec.kv_cache.block_manager import BlockManager
from tests.support.block_pool import check_pool, holders

pytestmark = pytest.mark.device_agnostic


#: The slot ids the unit tests use.
NAMES = "abcdx"


def snapshot(bm: BlockManager) -> tuple:
    """Everything observable about a manager, to check that a failed call changed nothing."""
    return bm.num_free_blocks, {s: (bm.length(s), bm.block_table(s)) for s in NAMES if bm.has_slot(s)}


def can_append(bm: BlockManager, slot: str, n: int) -> bool:
    return bm.blocks_needed(slot, n) <= bm.num_free_blocks


# ---- construction ---------------------------------------------------------------------------


def test_fresh_manager_is_all_free() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.num_blocks == 8 and bm.block_size == 4
    assert bm.num_free_blocks == 8
    assert bm.free_tokens == 32
    assert snapshot(bm) == (8, {})
    check_pool(bm, NAMES)


def test_default_block_size_is_16() -> None:
    assert BlockManager(4).block_size == 16


@pytest.mark.parametrize(
    ("num_blocks", "block_size"), [(0, 16), (-1, 16), (4, 0), (4, -2), (4.0, 16), (True, 16)]
)
def test_constructor_rejects_bad_sizes(num_blocks: object, block_size: object) -> None:
    with pytest.raises(InvalidArgumentError):
        BlockManager(num_blocks, block_size)  # type: ignore[arg-type]


# ---- allocate / has_slot ---------------------------------------------------------------


def test_allocate_registers_empty_slot() -> None:
    bm = BlockManager(4, 4)
    bm.allocate("a")
    assert bm.has_slot("a") and not bm.has_slot("b")
    assert bm.length("a") == 0
    assert bm.block_table("a") == []
    assert bm.num_free_blocks == 4
    check_pool(bm, NAMES)


def test_allocate_duplicate_raises_and_keeps_slot() -> None:
    bm = BlockManager(4, 4)
    bm.allocate("a")
    bm.append("a", 5)
    before = snapshot(bm)
    with pytest.raises(SlotExistsError):
        bm.allocate("a")
    assert snapshot(bm) == before


@pytest.mark.parametrize(
    "call",
    [
        lambda bm: bm.length("x"),
        lambda bm: bm.block_table("x"),
        lambda bm: bm.positions("x"),
        lambda bm: bm.blocks_needed("x", 1),
        lambda bm: bm.append("x", 1),
        lambda bm: bm.append_many([("a", 1), ("x", 1)]),
        lambda bm: bm.truncate_to("x", 0),
        lambda bm: bm.free("x"),
    ],
)
def test_unknown_slot_raises_not_found(call) -> None:
    bm = BlockManager(4, 4)
    bm.allocate("a")
    before = snapshot(bm)
    with pytest.raises(SlotNotFoundError) as info:
        call(bm)
    assert "'x'" in str(info.value)
    assert info.value.status_code_name == "NOT_FOUND"
    assert snapshot(bm) == before


# ---- append / blocks_needed -----------------------------------------------------------------


def test_blocks_needed_counts_room_in_last_block() -> None:
    bm = BlockManager(8, 4)
    bm.allocate("a")
    assert bm.blocks_needed("a", 0) == 0
    assert bm.blocks_needed("a", 1) == 1
    assert bm.blocks_needed("a", 4) == 1
    assert bm.blocks_needed("a", 5) == 2
    bm.append("a", 3)
    assert bm.blocks_needed("a", 1) == 0
    assert bm.blocks_needed("a", 2) == 1
    assert bm.blocks_needed("a", 6) == 2


def test_append_takes_blocks_in_fifo_order_and_returns_slot_mapping() -> None:
    bm = BlockManager(8, 4)
    bm.allocate("a")
    bm.allocate("b")
    assert bm.append("a", 3) == [0, 1, 2]  # block 0
    assert bm.append("b", 2) == [4, 5]  # block 1
    assert bm.append("a", 3) == [3, 8, 9]  # rest of block 0, then block 2
    assert bm.block_table("a") == [0, 2]
    assert bm.block_table("b") == [1]
    assert bm.length("a") == 6 and bm.length("b") == 2
    assert bm.num_free_blocks == 5
    assert bm.free_tokens == 20
    check_pool(bm, NAMES)


def test_append_zero_tokens_is_noop() -> None:
    bm = BlockManager(2, 4)
    bm.allocate("a")
    assert bm.append("a", 0) == []
    assert bm.block_table("a") == []
    check_pool(bm, NAMES)


def test_append_exactly_fills_pool() -> None:
    bm = BlockManager(2, 4)
    bm.allocate("a")
    assert can_append(bm, "a", 8)
    assert bm.append("a", 8) == list(range(8))
    assert bm.num_free_blocks == 0
    assert can_append(bm, "a", 0)
    assert not can_append(bm, "a", 1)


def test_append_exhaustion_changes_nothing() -> None:
    bm = BlockManager(3, 4)
    bm.allocate("a")
    bm.allocate("b")
    bm.append("a", 6)
    before = snapshot(bm)
    assert not can_append(bm, "b", 5)
    with pytest.raises(CapacityExhaustedError) as info:
        bm.append("b", 5)
    assert info.value.status_code_name == "RESOURCE_EXHAUSTED"
    assert snapshot(bm) == before
    check_pool(bm, NAMES)
    # the room left in a's last block is still usable without new blocks
    assert bm.append("a", 2) == [6, 7]
    assert bm.length("a") == 8


@pytest.mark.parametrize("bad", [-1, 1.5, "3", None, True])
def test_append_rejects_bad_counts(bad: object) -> None:
    bm = BlockManager(2, 4)
    bm.allocate("a")
    for call in (bm.append, bm.blocks_needed):
        with pytest.raises(InvalidArgumentError):
            call("a", bad)  # type: ignore[arg-type]
    assert bm.length("a") == 0


# ---- positions ------------------------------------------------------------------------------


def test_positions_follow_block_table() -> None:
    bm = BlockManager(6, 4)
    for s in "abc":
        bm.allocate(s)
    bm.append("a", 4)  # block 0
    bm.append("b", 4)  # block 1
    bm.append("c", 1)  # block 2
    bm.free("b")  # block 1 to the back of the free list: 3, 4, 5, 1
    bm.append("a", 9)  # blocks 3, 4, 5
    table = bm.block_table("a")
    assert table == [0, 3, 4, 5]
    expected = [table[i // 4] * 4 + i % 4 for i in range(13)]
    assert bm.positions("a") == expected
    assert bm.positions("a", 3, 9) == expected[3:9]
    assert bm.positions("a", 13) == []
    assert bm.positions("a", 5, 5) == []


@pytest.mark.parametrize(("start", "end"), [(-1, None), (0, 14), (5, 4), (14, None)])
def test_positions_rejects_bad_range(start: int, end: int | None) -> None:
    bm = BlockManager(6, 4)
    bm.allocate("a")
    bm.append("a", 13)
    with pytest.raises(InvalidArgumentError):
        bm.positions("a", start, end)


def test_block_table_is_a_copy() -> None:
    bm = BlockManager(4, 4)
    bm.allocate("a")
    bm.append("a", 5)
    bm.block_table("a").append(99)
    assert bm.block_table("a") == [0, 1]
    check_pool(bm, NAMES)


# ---- truncate_to ----------------------------------------------------------------------------


def test_truncate_keeps_partial_last_block_and_frees_blocks_at_or_after() -> None:
    bm = BlockManager(8, 4)
    bm.allocate("a")
    bm.append("a", 14)  # blocks 0..3, last holds 2 tokens
    bm.truncate_to("a", 5)  # keeps block 0 (full) and block 1 (1 token); frees 2, 3
    assert bm.length("a") == 5
    assert bm.block_table("a") == [0, 1]
    assert bm.num_free_blocks == 6
    check_pool(bm, NAMES)
    # the next append reuses the kept partial block first
    assert bm.append("a", 3) == [5, 6, 7]
    assert bm.block_table("a") == [0, 1]


def test_truncate_at_block_boundary_frees_block_starting_there() -> None:
    bm = BlockManager(8, 4)
    bm.allocate("a")
    bm.append("a", 9)  # blocks 0, 1, 2
    bm.truncate_to("a", 8)  # block 2 starts at 8: freed
    assert bm.block_table("a") == [0, 1]
    bm.truncate_to("a", 4)  # block 1 starts at 4: freed
    assert bm.block_table("a") == [0]
    assert bm.num_free_blocks == 7
    check_pool(bm, NAMES)


def test_truncate_to_zero_frees_all_blocks_but_keeps_slot() -> None:
    bm = BlockManager(4, 4)
    bm.allocate("a")
    bm.append("a", 10)
    bm.truncate_to("a", 0)
    assert bm.has_slot("a")
    assert bm.length("a") == 0
    assert bm.block_table("a") == []
    assert bm.num_free_blocks == 4
    check_pool(bm, NAMES)


def test_truncate_to_current_length_is_noop() -> None:
    bm = BlockManager(4, 4)
    bm.allocate("a")
    bm.append("a", 6)
    before = snapshot(bm)
    bm.truncate_to("a", 6)
    assert snapshot(bm) == before


@pytest.mark.parametrize("bad", [-1, 7, 100, 2.0, None])
def test_truncate_rejects_bad_lengths(bad: object) -> None:
    bm = BlockManager(4, 4)
    bm.allocate("a")
    bm.append("a", 6)
    before = snapshot(bm)
    with pytest.raises(InvalidArgumentError):
        bm.truncate_to("a", bad)  # type: ignore[arg-type]
    assert snapshot(bm) == before


def test_freed_blocks_go_to_back_of_free_list() -> None:
    bm = BlockManager(4, 4)
    bm.allocate("a")
    bm.allocate("b")
    bm.append("a", 4)  # block 0
    bm.truncate_to("a", 0)  # free list: 1, 2, 3, 0
    bm.append("b", 16)
    assert bm.block_table("b") == [1, 2, 3, 0]


# ---- free -----------------------------------------------------------------------------------


def test_free_returns_every_block_and_forgets_slot() -> None:
    bm = BlockManager(6, 4)
    bm.allocate("a")
    bm.allocate("b")
    bm.append("a", 9)
    bm.append("b", 3)
    bm.free("a")
    assert not bm.has_slot("a")
    assert bm.has_slot("b")
    assert bm.num_free_blocks == 5
    assert bm.block_table("b") == [3]
    check_pool(bm, NAMES)
    with pytest.raises(SlotNotFoundError):
        bm.free("a")
    bm.allocate("a")  # the id can be reused
    assert bm.length("a") == 0


def test_free_empty_slot() -> None:
    bm = BlockManager(2, 4)
    bm.allocate("a")
    bm.free("a")
    assert not bm.has_slot("a") and bm.num_free_blocks == 2


# ---- append_many ----------------------------------------------------------------------------


def test_append_many_returns_positions_per_request() -> None:
    bm = BlockManager(8, 4)
    bm.allocate("a")
    bm.allocate("b")
    bm.append("a", 2)  # block 0
    out = bm.append_many([("a", 3), ("b", 4), ("a", 1)])
    assert out == [[2, 3, 4], [8, 9, 10, 11], [5]]
    assert bm.block_table("a") == [0, 1]
    assert bm.block_table("b") == [2]
    assert bm.append_many([]) == []
    check_pool(bm, NAMES)


def test_append_many_is_all_or_nothing_on_exhaustion() -> None:
    bm = BlockManager(4, 4)
    bm.allocate("a")
    bm.allocate("b")
    bm.append("a", 2)
    before = snapshot(bm)
    # a alone fits (needs 1 more block), b alone fits (3 blocks), together they need 4 > 3
    assert can_append(bm, "a", 6) and can_append(bm, "b", 9)
    with pytest.raises(CapacityExhaustedError):
        bm.append_many([("a", 6), ("b", 9)])
    assert snapshot(bm) == before
    check_pool(bm, NAMES)


def test_append_many_counts_repeated_slot_cumulatively() -> None:
    bm = BlockManager(2, 4)
    bm.allocate("a")
    before = snapshot(bm)
    # each part alone needs 1-2 blocks; together they need 3 > 2
    with pytest.raises(CapacityExhaustedError):
        bm.append_many([("a", 5), ("a", 5)])
    assert snapshot(bm) == before
    assert bm.append_many([("a", 5), ("a", 3)]) == [[0, 1, 2, 3, 4], [5, 6, 7]]


@pytest.mark.parametrize("bad", [[("a", 1), ("x", 1)], [("a", 1), ("b", -1)]])
def test_append_many_validates_whole_batch_first(bad: list[tuple[str, int]]) -> None:
    bm = BlockManager(4, 4)
    bm.allocate("a")
    bm.allocate("b")
    before = snapshot(bm)
    with pytest.raises((SlotNotFoundError, InvalidArgumentError)):
        bm.append_many(bad)
    assert snapshot(bm) == before


# ---- prefix cache ---------------------------------------------------------------------------


def registered(bm: BlockManager, slot: str, tokens: list[int]) -> list[int]:
    """Allocate `slot`, append `tokens` and register its full blocks; its block table."""
    bm.allocate(slot)
    bm.append(slot, len(tokens))
    bm.register_full_blocks(slot, tokens)
    return bm.block_table(slot)


def test_a_registered_prefix_is_shared_and_outlives_its_slot() -> None:
    bm = BlockManager(8, 4)
    tokens = list(range(10))
    table = registered(bm, "a", tokens)
    assert bm.cached_prefix(list(range(13))) == table[:2]  # the partial third block is not registered
    prefix = bm.cached_prefix(tokens[:8] + [50, 51])
    assert prefix == table[:2]
    bm.allocate("b", prefix)
    assert (bm.length("b"), holders(bm, "ab", table[0]), bm.num_free_blocks) == (8, 2, 5)
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 8 and bm.cached_prefix(tokens) == table[:2]  # free, and still matchable
    check_pool(bm, NAMES)
    bm.allocate("c", bm.cached_prefix(tokens))  # a hit takes its blocks out of the free list
    assert bm.num_free_blocks == 6
    bm.free("c")
    bm.allocate("d")
    bm.append("d", 4 * 8)  # every block handed out again: the old contents are gone
    assert bm.cached_prefix(tokens) == []
    check_pool(bm, NAMES)


def test_a_prefix_match_is_whole_leading_blocks_and_leaves_the_last_token() -> None:
    bm = BlockManager(8, 4)
    table = registered(bm, "a", list(range(12)))
    assert bm.cached_prefix(list(range(12))) == table[:2]  # the last token's logits must be computed
    assert bm.cached_prefix(list(range(13))) == table[:3]
    assert bm.cached_prefix([99, *range(1, 12)]) == []  # the first block differs
    assert bm.cached_prefix([0, 1, 2, 3, 99, 5, 6, 7, 8, 9, 10, 11, 12]) == table[:1]
    # a block's key includes everything before it: the same four tokens after another block do not match
    other = [9, 9, 9, 9, 4, 5, 6, 7, 8]
    assert bm.cached_prefix(other) == []
    with pytest.raises(InvalidArgumentError):
        bm.allocate("x", [table[2], 7])  # block 7 holds nothing registered
    assert not bm.has_slot("x")


def test_truncating_into_a_shared_block_gives_the_slot_its_own_copy() -> None:
    bm = BlockManager(8, 4)
    tokens = list(range(10))
    table = registered(bm, "a", tokens)
    bm.allocate("b", bm.cached_prefix(tokens))
    copies = bm.truncate_to("b", 6)  # inside the shared second block
    new = bm.block_table("b")
    assert copies == [(table[1], new[1])] and new[0] == table[0] and new[1] not in table
    assert holders(bm, "ab", table[1]) == 1 and bm.block_table("a") == table
    assert bm.cached_prefix(tokens) == table[:2]  # a's block is still registered
    assert bm.truncate_to("b", 4) == []  # a block boundary: nothing is written into the shared block
    check_pool(bm, NAMES)


def test_truncating_into_an_own_registered_block_unregisters_it() -> None:
    bm = BlockManager(8, 4)
    tokens = list(range(10))
    table = registered(bm, "a", tokens)
    assert bm.truncate_to("a", 6) == []
    assert bm.cached_prefix(tokens) == table[:1]  # the second block will be overwritten
    bm.append("a", 2)
    bm.register_full_blocks("a", [*tokens[:6], 70, 71])
    assert bm.cached_prefix([*tokens[:6], 70, 71, 72]) == table[:2]
    check_pool(bm, NAMES)


def test_a_copy_needs_a_free_block_and_fails_without_changing_anything() -> None:
    bm = BlockManager(3, 4)
    tokens = list(range(8))
    registered(bm, "a", tokens)
    bm.allocate("b", bm.cached_prefix([*tokens, 99]))
    bm.allocate("c")
    bm.append("c", 4)  # the last free block
    with pytest.raises(CapacityExhaustedError):
        bm.truncate_to("b", 5)
    assert bm.length("b") == 8
    check_pool(bm, NAMES)


def test_the_same_content_registered_twice_keeps_the_first() -> None:
    bm = BlockManager(8, 4)
    tokens = list(range(9))
    first = registered(bm, "a", tokens)
    registered(bm, "b", tokens)  # computed again (e.g. in the same batch): not registered twice
    assert bm.cached_prefix(tokens) == first[:2]
    with pytest.raises(InvalidArgumentError):
        bm.register_full_blocks("a", tokens[:5])  # not the slot's tokens
    check_pool(bm, NAMES)


# ---- stateful property test -----------------------------------------------------------------

SLOTS = ("s0", "s1", "s2", "s3")
NUM_BLOCKS = 12
BLOCK_SIZE = 4


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate/append/append_many/truncate/free against a dict slot -> length."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.model: dict[str, int] = {}

    def expected_free(self, lengths: dict[str, int]) -> int:
        return NUM_BLOCKS - sum(ceil_div(n, BLOCK_SIZE) for n in lengths.values())

    def check_positions(self, slot: str, start: int, got: list[int]) -> None:
        assert got == self.bm.positions(slot, start, start + len(got))
        table = self.bm.block_table(slot)
        for i, pos in enumerate(got, start):
            assert pos == table[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE

    @rule(slot=st.sampled_from(SLOTS))
    def allocate(self, slot: str) -> None:
        if slot in self.model:
            with pytest.raises(SlotExistsError):
                self.bm.allocate(slot)
        else:
            self.bm.allocate(slot)
            self.model[slot] = 0

    @rule(slot=st.sampled_from(SLOTS), n=st.integers(0, 3 * BLOCK_SIZE + 1))
    def append(self, slot: str, n: int) -> None:
        if slot not in self.model:
            with pytest.raises(SlotNotFoundError):
                self.bm.append(slot, n)
            return
        new = dict(self.model, **{slot: self.model[slot] + n})
        if self.expected_free(new) < 0:
            assert not can_append(self.bm, slot, n)
            with pytest.raises(CapacityExhaustedError):
                self.bm.append(slot, n)
            return
        assert can_append(self.bm, slot, n)
        start = self.model[slot]
        got = self.bm.append(slot, n)
        assert len(got) == n
        self.model = new
        self.check_positions(slot, start, got)

    @rule(
        reqs=st.lists(
            st.tuples(st.sampled_from(SLOTS), st.integers(0, 2 * BLOCK_SIZE + 1)), max_size=4
        )
    )
    def append_many(self, reqs: list[tuple[str, int]]) -> None:
        if any(s not in self.model for s, _ in reqs):
            with pytest.raises(SlotNotFoundError):
                self.bm.append_many(reqs)
            return
        new = dict(self.model)
        for s, n in reqs:
            new[s] += n
        if self.expected_free(new) < 0:
            with pytest.raises(CapacityExhaustedError):
                self.bm.append_many(reqs)
            return
        starts = []
        running = dict(self.model)
        for s, n in reqs:
            starts.append(running[s])
            running[s] += n
        got = self.bm.append_many(reqs)
        self.model = new
        assert [len(g) for g in got] == [n for _, n in reqs]
        for (s, _), start, positions in zip(reqs, starts, got):
            self.check_positions(s, start, positions)

    @rule(slot=st.sampled_from(SLOTS), frac=st.floats(0, 1.2), overshoot=st.booleans())
    def truncate(self, slot: str, frac: float, overshoot: bool) -> None:
        if slot not in self.model:
            with pytest.raises(SlotNotFoundError):
                self.bm.truncate_to(slot, 0)
            return
        length = self.model[slot]
        if overshoot:
            with pytest.raises(InvalidArgumentError):
                self.bm.truncate_to(slot, length + 1)
            return
        new_len = min(length, int(length * frac))
        kept = self.bm.block_table(slot)[: ceil_div(new_len, BLOCK_SIZE)]
        kept_positions = self.bm.positions(slot, 0, new_len)
        self.bm.truncate_to(slot, new_len)
        self.model[slot] = new_len
        # surviving tokens keep their blocks and positions
        assert self.bm.block_table(slot) == kept
        assert self.bm.positions(slot) == kept_positions

    @rule(slot=st.sampled_from(SLOTS))
    def free(self, slot: str) -> None:
        if slot not in self.model:
            with pytest.raises(SlotNotFoundError):
                self.bm.free(slot)
            return
        self.bm.free(slot)
        del self.model[slot]

    @invariant()
    def agrees_with_model(self) -> None:
        check_pool(self.bm, SLOTS)
        assert [s for s in SLOTS if self.bm.has_slot(s)] == [s for s in SLOTS if s in self.model]
        for slot, n in self.model.items():
            assert self.bm.length(slot) == n
            assert len(self.bm.block_table(slot)) == ceil_div(n, BLOCK_SIZE)
        assert self.bm.num_free_blocks == self.expected_free(self.model)
        assert self.bm.free_tokens == self.bm.num_free_blocks * BLOCK_SIZE
        owned = [b for s in self.model for b in self.bm.block_table(s)]
        assert len(owned) == len(set(owned))  # no block owned twice
        assert len(owned) + self.bm.num_free_blocks == NUM_BLOCKS  # nothing leaked


#: Both state machines: 40 steps a run, no per-example deadline (pool checks are not timed).
MACHINE_SETTINGS = settings(stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BlockManagerMachine.TestCase.settings = settings(MACHINE_SETTINGS, max_examples=150)
TestBlockManagerMachine = BlockManagerMachine.TestCase


# ---- stateful property test of the prefix cache ---------------------------------------------


class PrefixCacheMachine(RuleBasedStateMachine):
    """Slots start from cached prefixes, grow, roll back and end, as an engine drives them
    (register after every append, free a new slot whose append failed). A shadow of the KV
    pool records what every written position holds, as the whole sequence up to it (the
    keys and values of a position depend on every token before it), and every slot must
    read its own sequence at every position: a shared or registered block is never written,
    and a copy carries its source's contents."""

    BLOCK = 2
    tokens_strategy = st.lists(st.integers(0, 1), max_size=9)  # two token values: prompts often agree

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(10, self.BLOCK)
        self.tokens: dict[str, list[int]] = {}
        self.pool: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> sequence up to there

    def write(self, slot: str, start: int) -> None:
        """Record the slot's tokens from `start` on as written, where its table puts them."""
        table, bs = self.bm.block_table(slot), self.BLOCK
        for i in range(start, len(self.tokens[slot])):
            block = table[i // bs]
            assert holders(self.bm, self.tokens, block) == 1, "a shared block was written"
            self.pool[(block, i % bs)] = tuple(self.tokens[slot][: i + 1])

    def grow(self, slot: str, new: list[int]) -> None:
        start = len(self.tokens[slot])
        self.bm.append(slot, len(new))
        self.tokens[slot] += new
        self.write(slot, start)
        self.bm.register_full_blocks(slot, self.tokens[slot])

    @rule(slot=st.sampled_from(SLOTS), prompt=tokens_strategy)
    def new_slot(self, slot: str, prompt: list[int]) -> None:
        if slot in self.tokens or not prompt:
            return
        prefix = self.bm.cached_prefix(prompt)
        cached = len(prefix) * self.BLOCK
        assert cached < len(prompt)
        self.bm.allocate(slot, prefix)
        self.tokens[slot] = prompt[:cached]
        try:
            self.grow(slot, prompt[cached:])
        except CapacityExhaustedError:
            self.bm.free(slot)
            del self.tokens[slot]

    @rule(slot=st.sampled_from(SLOTS), new=tokens_strategy)
    def append(self, slot: str, new: list[int]) -> None:
        if slot in self.tokens:
            try:
                self.grow(slot, new)
            except CapacityExhaustedError:
                pass  # all or nothing: unchanged

    @rule(slot=st.sampled_from(SLOTS), frac=st.floats(0, 1))
    def truncate(self, slot: str, frac: float) -> None:
        if slot not in self.tokens:
            return
        new_len = int(len(self.tokens[slot]) * frac)
        try:
            copies = self.bm.truncate_to(slot, new_len)
        except CapacityExhaustedError:
            return
        for source, copy in copies:
            for offset in range(self.BLOCK):
                if (source, offset) in self.pool:
                    self.pool[(copy, offset)] = self.pool[(source, offset)]
        del self.tokens[slot][new_len:]

    @rule(slot=st.sampled_from(SLOTS))
    def free(self, slot: str) -> None:
        if slot in self.tokens:
            self.bm.free(slot)
            del self.tokens[slot]

    @invariant()
    def every_slot_reads_its_own_sequence(self) -> None:
        check_pool(self.bm, SLOTS)
        for slot, tokens in self.tokens.items():
            table = self.bm.block_table(slot)
            for i in range(len(tokens)):
                assert self.pool.get((table[i // self.BLOCK], i % self.BLOCK)) == tuple(tokens[: i + 1])

    @invariant()
    def a_cached_prefix_holds_the_prompt(self) -> None:
        for tokens in self.tokens.values():
            for j, block in enumerate(self.bm.cached_prefix([*tokens, 0])):
                for offset in range(self.BLOCK):
                    assert self.pool.get((block, offset)) == tuple(tokens[: j * self.BLOCK + offset + 1])


PrefixCacheMachine.TestCase.settings = settings(MACHINE_SETTINGS, max_examples=200)
TestPrefixCacheMachine = PrefixCacheMachine.TestCase
