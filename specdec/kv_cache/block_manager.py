"""Paged KV cache bookkeeping: which physical blocks hold which slot's tokens.

The KV pool is `num_blocks` fixed-size blocks of `block_size` token positions each, so the
tensors behind it can be viewed as one flat array of `num_blocks * block_size` positions.
A slot (one request's cache entry) owns a *block table*: physical block ids in logical
order. Token `i` of a slot lives in block `table[i // block_size]` at offset
`i % block_size`, i.e. at flat position `table[i // block_size] * block_size + i % block_size`.
Those flat positions ("slot mapping") are what the model writes new K/V into.

A slot of length `n` owns exactly `ceil(n / block_size)` blocks; only its last block may be
partly used. This module is pure bookkeeping (no tensors), so it is cheap to test exhaustively.

Reference counts: every block has a count of the block tables that hold it, and returns to
the free list when its count drops to 0.

Prefix caching: a full block whose keys and values are known to be those of a token
sequence can be *registered* (`register_full_blocks`, after the forward that wrote it). Its
key is its own tokens plus the key of the block before it, so a match means the whole
prefix up to the block's end is the same: keys and values of a position depend on every
token before it. A new slot can start from the registered blocks matching its prompt
(`cached_prefix`, then `allocate(slot, prefix)`), shared with other slots (count > 1).
A freed registered block keeps its contents in the free list, still matchable, until it is
handed out again; free blocks go out oldest first, so a recently used prefix lasts. Keys
hold the tokens themselves, never a hash, so two different prefixes can never meet.
A shared block is never written: a slot that truncates into one gets its own copy of it
first (`truncate_to` returns the copies for the KV tensors to make), and a registered block
that a slot holds alone is unregistered when the slot truncates into it, before any write.
"""

from __future__ import annotations

import itertools
import operator
from collections import OrderedDict

from specdec.errors import (
    CapacityExhaustedError,
    InvalidArgumentError,
    SlotExistsError,
    SlotNotFoundError,
)


def _count(value: object, name: str) -> int:
    """A non-negative integer argument, or InvalidArgumentError (numpy ints accepted, bools not)."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be an integer, got bool", field=name)
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        kind = type(value).__name__
        raise InvalidArgumentError(f"{name} must be an integer, got {kind}", field=name) from None
    if n < 0:
        raise InvalidArgumentError(f"{name} must be >= 0, got {n}", field=name)
    return n


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Allocates fixed-size KV blocks to slots and maps token indices to flat cache positions.

    Free list order is FIFO: blocks are taken from the front and released blocks join the back.
    This is deterministic (a fresh manager hands out 0, 1, 2, ...) and keeps a just-released
    registered block's contents around as long as possible before reuse.
    """

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        self.num_blocks = _count(num_blocks, "num_blocks")
        self.block_size = _count(block_size, "block_size")
        if self.num_blocks == 0 or self.block_size == 0:
            raise InvalidArgumentError(
                f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}"
            )
        #: Free blocks in hand-out order (an ordered set: a prefix hit takes one from the middle).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_blocks))
        self._refcount: list[int] = [0] * self.num_blocks
        self._tables: dict[str, list[int]] = {}
        self._lengths: dict[str, int] = {}
        # Prefix cache: a registered block's key is (id of the block before it, its tokens);
        # its id is unique per registration (0 = no block before), never reused.
        self._block_of_key: dict[tuple[int, tuple[int, ...]], int] = {}
        #: Registered block -> (its key, its id).
        self._registered_as: dict[int, tuple[tuple[int, tuple[int, ...]], int]] = {}
        self._next_id = itertools.count(1)
        #: Leading blocks of each slot that are registered under the slot's own tokens.
        self._registered: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def free_tokens(self) -> int:
        """Tokens that fit in fresh free blocks (ignores spare room in slots' last blocks)."""
        return len(self._free) * self.block_size

    def has_slot(self, slot_id: str) -> bool:
        return slot_id in self._tables

    def length(self, slot_id: str) -> int:
        self._table(slot_id)
        return self._lengths[slot_id]

    def block_table(self, slot_id: str) -> list[int]:
        return list(self._table(slot_id))

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

    def allocate(self, slot_id: str, prefix: list[int] | None = None) -> None:
        """Register a slot: empty, or holding `prefix`, registered blocks that `cached_prefix`
        just matched (shared; their tokens are cached). Further blocks come with appends."""
        if slot_id in self._tables:
            raise SlotExistsError(f"slot {slot_id!r} is already allocated")
        prefix = list(prefix or [])
        if any(block_id not in self._registered_as for block_id in prefix):
            raise InvalidArgumentError(f"prefix of slot {slot_id!r}: only registered blocks can be shared")
        for block_id in prefix:
            if self._refcount[block_id] == 0:
                del self._free[block_id]
            self._refcount[block_id] += 1
        self._tables[slot_id] = prefix
        self._lengths[slot_id] = len(prefix) * self.block_size
        self._registered[slot_id] = len(prefix)

    # -- prefix cache ---------------------------------------------------------------------

    def cached_prefix(self, tokens: list[int]) -> list[int]:
        """The registered blocks holding the longest run of whole leading blocks of `tokens`,
        at most all but its last token (whose logits a prefill must still compute)."""
        blocks: list[int] = []
        parent = 0
        bs = self.block_size
        for i in range((len(tokens) - 1) // bs):
            block_id = self._block_of_key.get((parent, tuple(tokens[i * bs : (i + 1) * bs])))
            if block_id is None:
                break
            blocks.append(block_id)
            parent = self._registered_as[block_id][1]
        return blocks

    def register_full_blocks(self, slot_id: str, tokens: list[int]) -> None:
        """Make the slot's full blocks matchable, `tokens` being the slot's cached tokens
        (its keys and values are written). A block whose content is registered already
        (another slot computed the same prefix) ends the run: what follows it is keyed to it."""
        table = self._table(slot_id)
        if len(tokens) != self._lengths[slot_id]:
            raise InvalidArgumentError(f"slot {slot_id!r} caches {self._lengths[slot_id]} tokens, got {len(tokens)}")
        bs = self.block_size
        done = self._registered[slot_id]
        parent = self._registered_as[table[done - 1]][1] if done else 0
        for i in range(done, len(tokens) // bs):
            block_id = table[i]
            key = (parent, tuple(tokens[i * bs : (i + 1) * bs]))
            if key in self._block_of_key or block_id in self._registered_as:
                break
            parent = next(self._next_id)
            self._block_of_key[key], self._registered_as[block_id] = block_id, (key, parent)
            self._registered[slot_id] = i + 1

    def append(self, slot_id: str, num_new_tokens: int) -> list[int]:
        """Grow the slot by n tokens; return their flat cache positions. All-or-nothing."""
        needed = self.blocks_needed(slot_id, num_new_tokens)
        if needed > len(self._free):
            raise CapacityExhaustedError(
                f"KV pool: slot {slot_id!r} needs {needed} more blocks, {len(self._free)} free", resource="kv_blocks"
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
                f"KV pool: a batch of {len(requests)} appends needs {needed} more blocks, {len(self._free)} free",
                resource="kv_blocks",
            )
        return [self._append_unchecked(s, operator.index(n)) for s, n in requests]

    def truncate_to(self, slot_id: str, new_len: int) -> list[tuple[int, int]]:
        """Shrink the slot to `new_len` tokens, releasing blocks that start at or past it.

        A partly used last block is kept: its stale tail is overwritten by later appends. If
        that block is shared, the slot gets a fresh copy instead (CapacityExhaustedError,
        with nothing changed, when no block is free); if it is registered and the slot's
        alone, it is unregistered. Returns the (source, destination) blocks whose contents
        the caller must copy.
        """
        table = self._table(slot_id)
        new_len = _count(new_len, "new_len")
        if new_len > self._lengths[slot_id]:
            raise InvalidArgumentError(
                f"cannot truncate slot {slot_id!r} of length {self._lengths[slot_id]} to {new_len}"
            )
        keep = _ceil_div(new_len, self.block_size)
        copies = []
        partial = new_len % self.block_size != 0
        if partial and self._refcount[table[keep - 1]] > 1:
            if not self._free:
                raise CapacityExhaustedError(f"KV pool: slot {slot_id!r} needs a free block to roll back into a "
                                             "shared one", resource="kv_blocks")
            source, copy = table[keep - 1], self._take_free()
            self._release(source)
            table[keep - 1] = copy
            copies.append((source, copy))
        elif partial and table[keep - 1] in self._registered_as:
            self._unregister(table[keep - 1])
        for block_id in table[keep:]:
            self._release(block_id)
        del table[keep:]
        self._lengths[slot_id] = new_len
        self._registered[slot_id] = min(self._registered[slot_id], new_len // self.block_size)
        return copies

    def free(self, slot_id: str) -> None:
        """Release every block of the slot and forget it."""
        for block_id in self._table(slot_id):
            self._release(block_id)
        del self._tables[slot_id]
        del self._lengths[slot_id]
        del self._registered[slot_id]

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
            table.append(self._take_free())
        self._lengths[slot_id] = start + n
        return self.positions(slot_id, start, start + n)

    def _take_free(self) -> int:
        """The oldest free block, held once; its cached contents (if any) are forgotten."""
        block_id, _ = self._free.popitem(last=False)
        if block_id in self._registered_as:
            self._unregister(block_id)
        self._refcount[block_id] = 1
        return block_id

    def _unregister(self, block_id: int) -> None:
        """Forget a block's contents (it is about to be written); blocks keyed to it become unreachable."""
        del self._block_of_key[self._registered_as.pop(block_id)[0]]

    def _release(self, block_id: int) -> None:
        """Drop one reference; the block is free again when nobody holds it."""
        self._refcount[block_id] -= 1
        if self._refcount[block_id] == 0:
            self._free[block_id] = None
