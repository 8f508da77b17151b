"""The forward batch: built on the host in one copy, the same indices the earlier device-side
builder made; a forward asks the device nothing about them; a long chunk runs as pieces
with the one-forward results."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from specdec.errors import InvalidArgumentError
from specdec.kv_cache.paged_cache import PagedKVCache
from specdec.model.attention import GatherAttention, context_bias
from specdec.model.forward_batch import build_forward_batch, chunk_rounds
from specdec.model.llama import PagedLlama
from specdec.model.loader import LoadedModel


def _cache(lengths: dict[str, int]) -> PagedKVCache:
    """A small pool holding slots of `lengths` tokens, blocks handed out in turns."""
    cache = PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=32, block_size=4)
    for slot in lengths:
        cache.blocks.allocate(slot)
    for _ in range(max(lengths.values())):
        cache.blocks.append_many([(slot, 1) for slot, n in lengths.items() if cache.blocks.length(slot) < n])
    return cache


def _earlier_builder(cache: PagedKVCache, chunks: list[tuple[str, list[int]]]) -> dict[str, torch.Tensor]:
    """What the builder computed before it moved to the host: device tensor ops, a host sync
    for the longest context and a boolean-mask index."""
    ends = [cache.blocks.length(slot) for slot, _ in chunks]
    starts = [end - len(tokens) for end, (_, tokens) in zip(ends, chunks)]
    lens = [len(tokens) for _, tokens in chunks]
    width = max(lens)
    offsets = torch.arange(width)  # [T]
    start_t, len_t = torch.tensor(starts), torch.tensor(lens)  # [B] each
    positions = start_t[:, None] + offsets[None, :]  # [B, T]
    flat = torch.arange(len(chunks) * width).view(len(chunks), width)  # [B, T]
    context_lens = start_t + len_t
    tables = [cache.blocks.block_table(slot) for slot, _ in chunks]
    tables_t = torch.tensor([t + [0] * (max(map(len, tables)) - len(t)) for t in tables])  # [B, max_blocks]
    key_pos = torch.arange(int(context_lens.max()))  # [L]
    block_of = torch.clamp(key_pos // cache.block_size, max=tables_t.shape[1] - 1)
    return {
        "input_ids": torch.tensor([tokens + [0] * (width - len(tokens)) for _, tokens in chunks]),
        "positions": positions,
        "token_rows": flat[offsets[None, :] < len_t[:, None]],
        "last_rows": flat[:, 0] + len_t - 1,
        "write_index": torch.tensor([r for (slot, _), s in zip(chunks, starts)
                                     for r in cache.blocks.positions(slot, s)]),
        "context_index": tables_t[:, block_of] * cache.block_size + key_pos % cache.block_size,  # [B, L]
        "attn_mask": ((key_pos[None, None, :] <= positions[:, :, None])
                      & (key_pos[None, None, :] < context_lens[:, None, None]))[:, None],  # [B, 1, T, L]
    }


def test_the_batch_equals_the_earlier_builders() -> None:
    cache = _cache({"prompt": 11, "verify": 23, "decode": 6})
    chunks = [("prompt", list(range(1, 12))), ("verify", [5, 6, 7, 8]), ("decode", [9])]
    batch = build_forward_batch(cache, chunks)
    want = _earlier_builder(cache, chunks)
    for name in ("input_ids", "positions", "token_rows", "last_rows", "write_index"):
        assert torch.equal(getattr(batch, name), want[name]), name
    inputs = GatherAttention().prepare(batch, 1, torch.float32)
    length = want["context_index"].shape[1]
    assert inputs.context_index.shape[1] >= length  # the tables' width in blocks: up to a block more
    assert torch.equal(inputs.context_index[:, :length], want["context_index"])
    visible = context_bias(batch, torch.float32) == 0  # [B, 1, T, L']
    assert torch.equal(visible[..., :length], want["attn_mask"]) and not visible[..., length:].any()
    assert batch.fresh is False and batch.chunk_lens == [11, 4, 1]


def test_bad_chunks_are_refused() -> None:
    cache = _cache({"a": 3})
    with pytest.raises(InvalidArgumentError, match="empty"):
        build_forward_batch(cache, [])
    with pytest.raises(InvalidArgumentError, match="no tokens"):
        build_forward_batch(cache, [("a", [])])
    with pytest.raises(InvalidArgumentError, match="longer than its slot"):
        build_forward_batch(cache, [("a", [1, 2, 3, 4])])
    with pytest.raises(InvalidArgumentError, match="past its 3 tokens"):
        build_forward_batch(cache, [("a", [1, 2])], starts=[2])


def test_chunks_are_cut_into_rounds_of_bounded_pieces() -> None:
    rounds = chunk_rounds([("a", list(range(10))), ("b", [1, 2]), ("c", list(range(4)))], [5, 0, 0], 4)
    assert [[(p.chunk, p.start, len(p.tokens), p.ends_chunk) for p in pieces] for pieces in rounds] == [
        [(1, 0, 2, True), (2, 0, 4, True), (0, 5, 4, False)],  # the pieces that end their chunk first
        [(0, 9, 4, False)],
        [(0, 13, 2, True)],
    ]
    with pytest.raises(InvalidArgumentError):
        chunk_rounds([("a", [1])], [0], 0)


@contextmanager
def refusing_host_syncs() -> Iterator[None]:
    """Inside the block, the tensor methods that make the host wait for the device raise, and
    so does indexing with a boolean mask (its result's size is only known on the device)."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("host sync inside a forward")

    index = torch.Tensor.__getitem__

    def no_mask_index(self: torch.Tensor, key: object) -> torch.Tensor:
        keys = key if isinstance(key, tuple) else (key,)
        if any(isinstance(k, torch.Tensor) and k.dtype == torch.bool for k in keys):
            raise AssertionError("boolean-mask index inside a forward")
        return index(self, key)

    with pytest.MonkeyPatch.context() as patch:
        for name in ("item", "tolist", "__int__", "__float__", "__bool__", "nonzero", "cpu"):
            patch.setattr(torch.Tensor, name, refuse)
        patch.setattr(torch.Tensor, "__getitem__", no_mask_index)
        yield


def test_a_forward_asks_the_device_nothing(target_model: LoadedModel) -> None:
    """A batch of a prompt's rest after its first block (ALIGNED attention), a verify chunk and
    a decode (MASKED), then a fresh prompt (OWN_KEYS): built and run without a host sync."""
    runner = PagedLlama(target_model.model)
    cache = runner.new_cache(token_budget=256)
    for slot in ("a", "b", "c", "d"):
        cache.blocks.allocate(slot)
    runner.run(cache, [("a", list(range(100, 140))), ("b", list(range(100, 116))), ("c", [3, 4])])
    cache.blocks.append_many([("a", 3), ("b", 30), ("c", 1), ("d", 9)])
    for chunks in ([("a", [1, 2, 3]), ("b", list(range(30))), ("c", [4])], [("d", list(range(9)))]):
        with refusing_host_syncs():
            batch = build_forward_batch(cache, chunks)
            runner.forward(batch, cache, batch.token_rows)


def test_a_chunked_prefill_gives_the_one_forward_logits_and_cache(target_model: LoadedModel) -> None:
    runner = PagedLlama(target_model.model)
    prompts = [list(range(200, 290)), list(range(300, 337))]  # 90 and 37 tokens
    results = {}
    for chunk_tokens in (1 << 20, 32, 7):
        cache = runner.new_cache(token_budget=256)
        for slot in ("a", "b"):
            cache.blocks.allocate(slot)
        logits = runner.run(cache, [("a", prompts[0]), ("b", prompts[1])], logits="all", chunk_tokens=chunk_tokens)
        rows = [cache.blocks.positions(slot) for slot in ("a", "b")]
        results[chunk_tokens] = logits, [torch.stack([kv[r] for kv in cache.kv]) for r in rows]
    (want_logits, want_kv) = results[1 << 20]
    for chunk_tokens in (32, 7):
        got_logits, got_kv = results[chunk_tokens]
        for got, want in zip([*got_logits, *got_kv], [*want_logits, *want_kv]):
            torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=0)
