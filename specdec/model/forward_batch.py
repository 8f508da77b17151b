"""Turn a batch of (slot, new tokens) chunks into the index tensors one forward pass needs.

One batched call serves every kind of work at once: a prompt prefill (long chunk at
position 0), a verify chunk [g, t1..tK] after a rollback (short chunk at the slot's cached
length) and a single-token decode (chunk of one). Chunks are right-padded to the longest;
padding rows compute garbage that is never written to the cache nor read back.

Everything is computed on the host from Python ints (the block manager's tables and lengths
are host data) and reaches the device in one copy: no step of a forward waits for the device
to answer a question about its own indices. A long chunk can be cut into pieces that run one
forward after another (`chunk_rounds`), so a long prompt's prefill needs bounded memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.errors import InvalidArgumentError
from specdec.kv_cache.paged_cache import PagedKVCache

Chunk = tuple[str, list[int]]


@dataclass(frozen=True)
class ForwardBatch:
    """Inputs of `PagedLlama.forward` for one batch of chunks (B requests, T = longest chunk,
    n real tokens, M = blocks of the longest context)."""

    input_ids: torch.Tensor  # [B, T] new tokens, right-padded with 0
    positions: torch.Tensor  # [B, T] absolute position of each new token (padding counts on past the chunk)
    token_rows: torch.Tensor  # [n] index of each real (non-padding) token in the flattened [B*T]
    last_rows: torch.Tensor  # [B] index of each chunk's last token in the flattened [B*T]
    #: Rows of the flattened [B*T] whose keys and values are written: the real tokens; in a fixed
    #: shape every row, padding to the pool's scratch row, so the step's shapes never change.
    kv_rows: torch.Tensor  # [w]
    write_index: torch.Tensor  # [w] pool row each of `kv_rows` writes
    block_tables: torch.Tensor  # [B, M] pool blocks of each request's context, right-padded with block 0
    context_lens: torch.Tensor  # [B] tokens of each request's context, its chunk included
    chunk_lens: list[int]
    block_size: int
    #: Every chunk starts at position 0 (a new prompt, or its first piece): each request's
    #: context is its chunk, so attention needs no cached keys.
    fresh: bool


def check_chunks(chunks: list[Chunk]) -> None:
    """InvalidArgumentError for an empty batch or a chunk without tokens."""
    if not chunks:
        raise InvalidArgumentError("batch is empty")
    for slot_id, tokens in chunks:
        if not tokens:
            raise InvalidArgumentError(f"slot {slot_id!r}: chunk has no tokens")


@dataclass(frozen=True)
class StepShape:
    """The one shape every forward of a fixed-shape step has: `requests` chunks of `tokens`
    tokens over `blocks` KV blocks each, real chunks first, then padding requests that see one
    key; every padding token writes the pool's scratch row. Equal shapes run the same kernels,
    so a token's logits do not depend on its batch, its chunk or its row (batch-invariant
    verification), and a step's tensors keep their shapes and addresses (CUDA graphs)."""

    requests: int
    tokens: int
    blocks: int


def build_forward_batch(
    cache: PagedKVCache, chunks: list[Chunk], starts: list[int] | None = None, shape: StepShape | None = None
) -> ForwardBatch:
    """The index tensors of one forward over chunks whose blocks are ALREADY appended to their slots.

    Pure: it only reads the block tables (the engine allocated the blocks, e.g. with
    `cache.blocks.append_many`). Chunk i holds the slot's tokens from `starts[i]` on; by
    default each chunk is the last `len(tokens)` tokens of its slot. With a `shape`, the batch
    is padded to it (`StepShape`).
    """
    starts = _checked_starts(cache, chunks, starts)
    chunk_lens = [len(tokens) for _, tokens in chunks]
    bs = cache.block_size
    ends = [start + n for start, n in zip(starts, chunk_lens)]
    slots = [slot_id for slot_id, _ in chunks]
    tables = [cache.blocks.block_table(slot)[: -(-end // bs)] for slot, end in zip(slots, ends)]
    fixed = shape is not None
    if shape is None:
        shape = StepShape(len(chunks), max(chunk_lens), max(len(table) for table in tables))
    _check_fits(shape, chunk_lens, tables)
    bsz, width, max_blocks = shape.requests, shape.tokens, shape.blocks
    padding = bsz - len(chunks)
    host = [  # each field's values, row-major, in ForwardBatch's order
        [t for _, tokens in chunks for t in tokens + [0] * (width - len(tokens))] + [0] * (padding * width),
        [start + t for start in starts + [0] * padding for t in range(width)],
        [b * width + t for b, n in enumerate(chunk_lens) for t in range(n)],
        [b * width + n - 1 for b, n in enumerate(chunk_lens)],
        [row for slot, start, end in zip(slots, starts, ends) for row in cache.blocks.positions(slot, start, end)],
        [block for table in tables + [[]] * padding for block in table + [0] * (max_blocks - len(table))],
        ends + [1] * padding,  # a padding request sees the first key of block 0: finite garbage
    ]
    if fixed:  # every row writes: the real ones their tokens' rows, the padding the scratch row
        written = {row: pool for row, pool in zip(host[2], host[4])}
        host.append(list(range(bsz * width)))
        host[4] = [written.get(row, cache.scratch_row) for row in range(bsz * width)]
    else:
        host.append(host[2])
    input_ids, positions, token_rows, last_rows, write_index, tables_t, context_lens, kv_rows = _to_device(
        host, cache.device
    )
    return ForwardBatch(
        input_ids=input_ids.view(bsz, width),
        positions=positions.view(bsz, width),
        token_rows=token_rows,
        last_rows=last_rows,
        kv_rows=kv_rows,
        write_index=write_index,
        block_tables=tables_t.view(bsz, max_blocks),
        context_lens=context_lens,
        chunk_lens=chunk_lens,
        block_size=bs,
        fresh=not fixed and all(start == 0 for start in starts),
    )


def _check_fits(shape: StepShape, chunk_lens: list[int], tables: list[list[int]]) -> None:
    """InvalidArgumentError unless the chunks fit `shape`."""
    if len(chunk_lens) > shape.requests or max(chunk_lens) > shape.tokens:
        raise InvalidArgumentError(
            f"{len(chunk_lens)} chunks of up to {max(chunk_lens)} tokens do not fit a step of "
            f"{shape.requests} x {shape.tokens}"
        )
    if max(len(table) for table in tables) > shape.blocks:
        raise InvalidArgumentError(f"a context needs more than the step's {shape.blocks} blocks")


def _checked_starts(cache: PagedKVCache, chunks: list[Chunk], starts: list[int] | None) -> list[int]:
    """Each chunk's start in its slot (default: the slot's length minus the chunk's), checked."""
    check_chunks(chunks)
    lengths = [cache.blocks.length(slot_id) for slot_id, _ in chunks]
    if starts is None:
        starts = [length - len(tokens) for length, (_, tokens) in zip(lengths, chunks)]
    for (slot_id, tokens), start, length in zip(chunks, starts, lengths):
        if start < 0:
            raise InvalidArgumentError("a chunk is longer than its slot: append the chunks to their slots first")
        if start + len(tokens) > length:
            end = start + len(tokens)
            raise InvalidArgumentError(f"slot {slot_id!r}: chunk ends at {end}, past its {length} tokens")
    return starts


def _to_device(parts: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """`parts` as int64 tensors on `device`, sent in one host-to-device copy: from pinned memory
    and without waiting on CUDA, so the host goes on to launch the forward's kernels."""
    flat = torch.tensor([v for part in parts for v in part], dtype=torch.long, pin_memory=device.type == "cuda")
    return list(flat.to(device, non_blocking=True).split([len(part) for part in parts]))


@dataclass(frozen=True)
class Piece:
    """A run of one chunk's tokens that one forward computes."""

    chunk: int  # index of its chunk in the call
    start: int  # slot position of its first token
    tokens: list[int]
    ends_chunk: bool  # its last token is its chunk's last


def chunk_rounds(chunks: list[Chunk], starts: list[int], max_tokens: int) -> list[list[Piece]]:
    """The forwards that compute `chunks` (chunk i from slot position `starts[i]`) with every
    chunk cut into pieces of at most `max_tokens`: round r holds piece r of each chunk that
    has one, the pieces that end their chunk first. A round's attention sees the pieces
    before it in the cache, so the rounds give the one-forward results in bounded memory."""
    if max_tokens <= 0:
        raise InvalidArgumentError(f"max_tokens must be > 0, got {max_tokens}", field="max_tokens")
    check_chunks(chunks)
    rounds: list[list[Piece]] = []
    for r in range(-(-max(len(tokens) for _, tokens in chunks) // max_tokens)):
        pieces = [
            Piece(i, start + r * max_tokens, tokens[r * max_tokens : (r + 1) * max_tokens],
                  len(tokens) <= (r + 1) * max_tokens)
            for i, ((_, tokens), start) in enumerate(zip(chunks, starts))
            if len(tokens) > r * max_tokens
        ]
        rounds.append(sorted(pieces, key=lambda piece: not piece.ends_chunk))
    return rounds
