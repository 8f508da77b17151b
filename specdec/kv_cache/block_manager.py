"""Paged KV cache bookkeeping: which physical blocks hold which slot's tokens.

The KV pool is `num_blocks` fixed-size blocks of `block_size` token positions each, so the
tensors behind it can be viewed as one flat array of `num_blocks * block_size` positions.
A slot (one request's cache entry) owns a *block table*: physical block ids in logical
order. Token `i` of a slot lives in block `table[i // block_size]` at offset
`i % block_size`, i.e. at flat position `table[i // block_size] * block_size + i % block_size`.
Those flat positions ("slot mapping") are what the model writes new K/V into.

A slot of length `n` owns exactly `ceil(n / block_size)` blocks; only its last block may be
partly used. This module is pure bookkeeping (no tensors), so it is cheap to test exhaustively.

Reference counts: every block has a count of the block tables that hold it. Today a block is
handed out with count 1 and returns to the free list when its count drops to 0. Prefix caching
will later let several slots share full prompt blocks (count > 1); release already goes through
the count, so only the sharing side needs adding.
"""

from __future__ import annotations

import operator
from collections import deque

from specdec.errors import (
    CapacityExhaustedError,
    InvalidArgumentError,
    SlotExistsError,
    SlotNotFoundError,
)


def _count(value: object, name: str) -> int:
    """A non-negative integer argument, or InvalidArgumentError (numpy ints accepted, bools not)."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be an integer, got bool")
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        kind = type(value).__name__
        raise InvalidArgumentError(f"{name} must be an integer, got {kind}") from None
    if n < 0:
        raise InvalidArgumentError(f"{name} must be >= 0, got {n}")
    return n


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Allocates fixed-size KV blocks to slots and maps token indices to flat cache positions.

    Free list order is FIFO: blocks are taken from the front and released blocks join the back.
    This is deterministic (a fresh manager hands out 0, 1, 2, ...) and, once prefix caching
    lands, it keeps a just-released block's contents around as long as possible before reuse.
    """

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        self.num_blocks = _count(num_blocks, "num_blocks")
        self.block_size = _count(block_size, "block_size")
        if self.num_blocks == 0 or self.block_size == 0:
            raise InvalidArgumentError(
                f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}"
            )
        self._free: deque[int] = deque(range(self.num_blocks))
        self._refcount: list[int] = [0] * self.num_blocks
        self._tables: dict[str, list[int]] = {}
        self._lengths: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def free_tokens(self) -> int:
        """Tokens that fit in fresh free blocks (ignores spare room in slots' last blocks)."""
        return len(self._free) * self.block_size

    def has_slot(self, slot_id: str) -> bool:
        return slot_id in self._tables

    def slot_ids(self) -> list[str]:
        return list(self._tables)

    def length(self, slot_id: str) -> int:
        self._table(slot_id)
        return self._lengths[slot_id]

    def block_table(self, slot_id: str) -> list[int]:
        return list(self._table(slot_id))

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def positions(self, slot_id: str, start: int = 0, end: int | None = None) -> list[int]:
        """Flat cache positions of tokens [start, end) of the slot (end defaults to its length)."""
        table = self._table(slot_id)
        length = self._lengths[slot_id]
        start = _count(start, "start")
        end = length if end is None else _count(end, "end")
        if not start <= end <= length:
            raise InvalidArgumentError(
                f"positions range [{start}, {end}) is outside slot {slot_id!r} of length {length}"
            )
        bs = self.block_size
        return [table[i // bs] * bs + i % bs for i in range(start, end)]

    def blocks_needed(self, slot_id: str, num_new_tokens: int) -> int:
        """Extra blocks an append of `num_new_tokens` would take from the free list."""
        n = _count(num_new_tokens, "num_new_tokens")
        table = self._table(slot_id)
        return _ceil_div(self._lengths[slot_id] + n, self.block_size) - len(table)

    def can_append(self, slot_id: str, num_new_tokens: int) -> bool:
        return self.blocks_needed(slot_id, num_new_tokens) <= len(self._free)

    def allocate(self, slot_id: str) -> None:
        """Register an empty slot (0 tokens, no blocks); blocks come with the first append."""
        if slot_id in self._tables:
            raise SlotExistsError(f"slot {slot_id!r} is already allocated")
        self._tables[slot_id] = []
        self._lengths[slot_id] = 0

    def append(self, slot_id: str, num_new_tokens: int) -> list[int]:
        """Grow the slot by n tokens; return their flat cache positions. All-or-nothing."""
        needed = self.blocks_needed(slot_id, num_new_tokens)
        if needed > len(self._free):
            raise CapacityExhaustedError(
                f"slot {slot_id!r} needs {needed} more KV blocks, {len(self._free)} free"
            )
        return self._append_unchecked(slot_id, operator.index(num_new_tokens))

    def append_many(self, requests: list[tuple[str, int]]) -> list[list[int]]:
        """Append to several slots at once; if the whole batch does not fit, change nothing.

        A slot may appear more than once; its appends apply in list order.
        """
        pending: dict[str, int] = {}
        for slot_id, num_new_tokens in requests:
            self._table(slot_id)
            pending[slot_id] = pending.get(slot_id, 0) + _count(num_new_tokens, "num_new_tokens")
        needed = sum(self.blocks_needed(s, n) for s, n in pending.items())
        if needed > len(self._free):
            raise CapacityExhaustedError(
                f"batch of {len(requests)} appends needs {needed} more KV blocks, "
                f"{len(self._free)} free"
            )
        return [self._append_unchecked(s, operator.index(n)) for s, n in requests]

    def truncate_to(self, slot_id: str, new_len: int) -> None:
        """Shrink the slot to `new_len` tokens, releasing blocks that start at or past it.

        A partly used last block is kept: its stale tail is overwritten by later appends.
        """
        table = self._table(slot_id)
        new_len = _count(new_len, "new_len")
        if new_len > self._lengths[slot_id]:
            raise InvalidArgumentError(
                f"cannot truncate slot {slot_id!r} of length {self._lengths[slot_id]} to {new_len}"
            )
        keep = _ceil_div(new_len, self.block_size)
        for block_id in table[keep:]:
            self._release(block_id)
        del table[keep:]
        self._lengths[slot_id] = new_len

    def free(self, slot_id: str) -> None:
        """Release every block of the slot and forget it."""
        for block_id in self._table(slot_id):
            self._release(block_id)
        del self._tables[slot_id]
        del self._lengths[slot_id]

    def check_invariants(self) -> None:
        """Raise RuntimeError if the bookkeeping is inconsistent (a bug, never bad input)."""
        owners = [0] * self.num_blocks
        for slot_id, table in self._tables.items():
            length = self._lengths[slot_id]
            if length < 0 or len(table) != _ceil_div(length, self.block_size):
                raise RuntimeError(f"slot {slot_id!r}: {len(table)} blocks for {length} tokens")
            if len(set(table)) != len(table):
                raise RuntimeError(f"slot {slot_id!r} holds a block twice: {table}")
            for block_id in table:
                owners[block_id] += 1
        if len(set(self._free)) != len(self._free):
            raise RuntimeError("free list holds a block twice")
        free = set(self._free)
        for block_id in range(self.num_blocks):
            count = self._refcount[block_id]
            if count != owners[block_id]:
                raise RuntimeError(
                    f"block {block_id}: refcount {count}, {owners[block_id]} owner(s)"
                )
            if (count == 0) != (block_id in free):
                raise RuntimeError(f"block {block_id}: refcount {count}, free: {block_id in free}")

    def _table(self, slot_id: str) -> list[int]:
        try:
            return self._tables[slot_id]
        except KeyError:
            raise SlotNotFoundError(f"slot {slot_id!r} not found") from None

    def _append_unchecked(self, slot_id: str, n: int) -> list[int]:
        """Append after the caller has checked capacity; cannot fail."""
        table = self._tables[slot_id]
        start = self._lengths[slot_id]
        for _ in range(_ceil_div(start + n, self.block_size) - len(table)):
            block_id = self._free.popleft()
            self._refcount[block_id] = 1
            table.append(block_id)
        self._lengths[slot_id] = start + n
        return self.positions(slot_id, start, start + n)

    def _release(self, block_id: int) -> None:
        """Drop one reference; the block is free again when nobody holds it."""
        self._refcount[block_id] -= 1
        if self._refcount[block_id] == 0:
            self._free.append(block_id)
