"""A block manager's bookkeeping checked through what it shows: slot lengths, block tables, free count."""

from __future__ import annotations

from collections.abc import Iterable

from specdec.kv_cache.block_manager import BlockManager


def check_pool(blocks: BlockManager, slots: Iterable[str]) -> None:
    """Of `slots`, those the manager holds must be all it holds, each owning ceil(length /
    block_size) blocks, none twice; every block no slot holds is free, and only those (a
    block shared through the prefix cache counts once)."""
    held: set[int] = set()
    for slot in slots:
        if not blocks.has_slot(slot):
            continue
        table, length = blocks.block_table(slot), blocks.length(slot)
        assert len(table) == -(-length // blocks.block_size), f"slot {slot!r}: {len(table)} blocks for {length} tokens"
        assert len(set(table)) == len(table), f"slot {slot!r} holds a block twice: {table}"
        held.update(table)
    assert blocks.num_free_blocks == blocks.num_blocks - len(held), (
        f"{blocks.num_free_blocks} free blocks, {len(held)} of {blocks.num_blocks} held: a leak or a stray slot"
    )


def holders(blocks: BlockManager, slots: Iterable[str], block: int) -> int:
    """How many of `slots` hold `block` (its reference count, when `slots` are all the slots)."""
    return sum(block in blocks.block_table(slot) for slot in slots if blocks.has_slot(slot))
