"""Turn a batch of (slot, new tokens) chunks into the index tensors one forward pass needs.

One batched call serves every kind of work at once: a prompt prefill (long chunk at
position 0), a verify chunk [g, t1..tK] after a rollback (short chunk at the slot's cached
length) and a single-token decode (chunk of one). Chunks are right-padded to the longest;
padding rows compute garbage that is never written to the cache nor read back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.errors import InvalidArgumentError
from specdec.kv_cache.paged_cache import PagedKVCache


@dataclass(frozen=True)
class ForwardBatch:
    """Inputs of `PagedLlama.forward` for one batch of chunks (B requests, T = longest chunk, L = longest context)."""

    input_ids: torch.Tensor  # [B, T] new tokens, right-padded with 0
    positions: torch.Tensor  # [B, T] absolute position of each new token
    token_rows: torch.Tensor  # [n_real] index of each real (non-padding) token in the flattened [B*T]
    last_rows: torch.Tensor  # [B] index of each chunk's last token in the flattened [B*T]
    write_index: torch.Tensor  # [n_real] flat cache row of each real token, row-major over (B, T)
    context_index: torch.Tensor  # [B, L] flat cache rows of each request's whole context, padded
    attn_mask: torch.Tensor  # [B, 1, T, L] bool, True where a query may attend a key
    chunk_lens: list[int]

    def flat_rows(self, which: str) -> torch.Tensor:
        """Indices into the flattened [B*T] hidden states: "last" token of each chunk, or "all" real tokens."""
        if which == "last":
            return self.last_rows
        if which == "all":
            return self.token_rows
        raise ValueError(f"which must be 'last' or 'all', got {which!r}")


def build_forward_batch(cache: PagedKVCache, chunks: list[tuple[str, list[int]]]) -> ForwardBatch:
    """The index tensors of one forward over chunks ALREADY appended to their slots.

    Pure: it only reads the block tables (the engine allocated the blocks, e.g. with
    `cache.blocks.append_many`); each chunk is the last `len(tokens)` tokens of its slot.
    """
    if not chunks:
        raise InvalidArgumentError("batch is empty")
    for slot_id, tokens in chunks:
        if not tokens:
            raise InvalidArgumentError(f"slot {slot_id!r}: chunk has no tokens")
    device = cache.device
    ends = [cache.blocks.length(slot_id) for slot_id, _ in chunks]
    starts = [end - len(tokens) for end, (_, tokens) in zip(ends, chunks)]
    if min(starts) < 0:
        raise InvalidArgumentError("a chunk is longer than its slot: append the chunks to their slots first")
    write_rows = [cache.blocks.positions(slot_id, start) for (slot_id, _), start in zip(chunks, starts)]

    chunk_lens = [len(tokens) for _, tokens in chunks]
    width = max(chunk_lens)
    ids = [tokens + [0] * (width - len(tokens)) for _, tokens in chunks]
    input_ids = torch.tensor(ids, dtype=torch.long, device=device)  # [B, T]
    offsets = torch.arange(width, device=device)  # [T]
    start_t = torch.tensor(starts, dtype=torch.long, device=device)  # [B]
    len_t = torch.tensor(chunk_lens, dtype=torch.long, device=device)  # [B]
    positions = start_t[:, None] + offsets[None, :]  # [B, T]
    token_mask = offsets[None, :] < len_t[:, None]  # [B, T]
    flat = torch.arange(len(chunks) * width, device=device).view(len(chunks), width)  # [B, T]
    write_index = torch.tensor([row for rows in write_rows for row in rows], dtype=torch.long, device=device)

    context_lens = start_t + len_t  # [B]
    max_context = int(context_lens.max())
    tables = cache.block_tables([slot_id for slot_id, _ in chunks])  # [B, max_blocks]
    key_pos = torch.arange(max_context, device=device)  # [L]
    block_of = torch.clamp(key_pos // cache.block_size, max=tables.shape[1] - 1)  # [L]
    context_index = tables[:, block_of] * cache.block_size + key_pos % cache.block_size  # [B, L]
    attn_mask = (key_pos[None, None, :] <= positions[:, :, None]) & (
        key_pos[None, None, :] < context_lens[:, None, None]
    )  # [B, T, L]: causal inside the chunk, everything cached before it, nothing past the context
    return ForwardBatch(
        input_ids=input_ids,
        positions=positions,
        token_rows=flat[token_mask],
        last_rows=flat[:, 0] + len_t - 1,
        write_index=write_index,
        context_index=context_index,
        attn_mask=attn_mask[:, None],
        chunk_lens=chunk_lens,
    )
