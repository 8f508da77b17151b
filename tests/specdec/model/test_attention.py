"""The attention seam: every kernel and layout gives the reference's numbers (fp32, 1e-5),
over mixed batches whose requests sit at different positions in scattered blocks, and the
model's logits do not depend on the kernel."""

from __future__ import annotations

import pytest
import torch

from specdec.kv_cache.paged_cache import PagedKVCache
from specdec.model.attention import (
    AttentionKernel,
    ContextLayout,
    GatherAttention,
    SdpaAttention,
    default_kernel,
    make_attention,
)
from specdec.model.forward_batch import ForwardBatch, StepShape, build_forward_batch
from specdec.model.llama import PagedLlama
from specdec.model.loader import LoadedModel

HEADS, KV_HEADS, DIM = 6, 2, 16  # three query heads per KV head
ATOL = 1e-5


def _pool(lengths: dict[str, int]) -> PagedKVCache:
    """A one-layer pool of random keys and values holding slots of `lengths` tokens, their
    blocks handed out in turns so that no slot's blocks are contiguous."""
    cache = PagedKVCache(num_layers=1, num_kv_heads=KV_HEADS, head_dim=DIM, num_blocks=64, block_size=4)
    cache.kv[0].copy_(torch.randn(cache.kv[0].shape, generator=torch.Generator().manual_seed(0)))
    for slot in lengths:
        cache.blocks.allocate(slot)
    for _ in range(max(lengths.values())):
        cache.blocks.append_many([(slot, 1) for slot, n in lengths.items() if cache.blocks.length(slot) < n])
    return cache


def _attend(kernel: AttentionKernel, cache: PagedKVCache, batch: ForwardBatch, seed: int = 1) -> torch.Tensor:
    """The kernel's output at the batch's real tokens, after writing the chunk's keys and
    values as a layer does. # [n, H, D]"""
    gen = torch.Generator().manual_seed(seed)
    bsz, width = batch.input_ids.shape
    q = torch.randn(bsz, HEADS, width, DIM, generator=gen)  # [B, H, T, D]
    new = torch.randn(bsz, width, 2, KV_HEADS, DIM, generator=gen)  # [B, T, 2, Hkv, D]
    kv = cache.kv[0].clone()
    kv.index_put_((batch.write_index,), new.view(bsz * width, 2, KV_HEADS, DIM).index_select(0, batch.kv_rows))
    attention = make_attention(kernel)
    out = attention(q, new, kv, attention.prepare(batch, HEADS // KV_HEADS, torch.float32))  # [B, H, T, D]
    return out.transpose(1, 2).reshape(bsz * width, HEADS, DIM).index_select(0, batch.token_rows)


# Each batch: slot -> (cached tokens before the chunk, chunk length).
BATCHES = {
    ContextLayout.OWN_KEYS: {"a": (0, 13), "b": (0, 5), "c": (0, 1)},  # fresh prompts of three lengths
    ContextLayout.ALIGNED: {"a": (4, 30), "b": (20, 1), "c": (0, 7)},  # a prompt after a cached block, a decode
    ContextLayout.MASKED: {"a": (37, 5), "b": (20, 1), "c": (9, 1), "d": (3, 4)},  # verify chunks and decodes
}


@pytest.mark.parametrize("layout", list(BATCHES), ids=lambda layout: layout.value)
def test_sdpa_gives_the_reference_numbers_in_every_layout(layout: ContextLayout) -> None:
    shape = BATCHES[layout]
    cache = _pool({slot: cached + n for slot, (cached, n) in shape.items()})
    batch = build_forward_batch(cache, [(slot, [1] * n) for slot, (_, n) in shape.items()])
    assert SdpaAttention().prepare(batch, 3, torch.float32).layout is layout
    reference = _attend(AttentionKernel.GATHER, cache, batch)
    torch.testing.assert_close(_attend(AttentionKernel.SDPA, cache, batch), reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kernel", list(AttentionKernel), ids=lambda kernel: kernel.value)
def test_block_tables_padded_to_a_fixed_width_change_nothing(kernel: AttentionKernel) -> None:
    """The shapes a CUDA graph would capture: every step's tables as wide as the longest sequence's."""
    shape = BATCHES[ContextLayout.MASKED]
    cache = _pool({slot: cached + n for slot, (cached, n) in shape.items()})
    chunks = [(slot, [1] * n) for slot, (_, n) in shape.items()]
    widest = max(n for _, (_, n) in shape.items())
    wide = build_forward_batch(cache, chunks, shape=StepShape(len(chunks), widest, 32))
    assert wide.block_tables.shape == (len(chunks), 32)
    torch.testing.assert_close(_attend(kernel, cache, wide), _attend(kernel, cache, build_forward_batch(cache, chunks)),
                               atol=ATOL, rtol=0)


def test_the_reference_reads_every_cached_key_and_none_past_the_context() -> None:
    """GATHER against attention written out per request and query from the pool rows."""
    shape = BATCHES[ContextLayout.MASKED]
    cache = _pool({slot: cached + n for slot, (cached, n) in shape.items()})
    batch = build_forward_batch(cache, [(slot, [1] * n) for slot, (_, n) in shape.items()])
    got = _attend(AttentionKernel.GATHER, cache, batch)
    gen = torch.Generator().manual_seed(1)
    width = batch.input_ids.shape[1]
    q = torch.randn(len(shape), HEADS, width, DIM, generator=gen)
    new = torch.randn(len(shape), width, 2, KV_HEADS, DIM, generator=gen)
    rows = 0
    for b, (slot, (cached, n)) in enumerate(shape.items()):
        for t in range(n):
            cached_rows = cache.kv[0][cache.blocks.positions(slot, 0, cached)]
            keys = torch.cat([cached_rows, new[b, : t + 1]])  # [p+1, 2, Hkv, D]
            k = keys[:, 0].repeat_interleave(3, dim=1).transpose(0, 1)  # [H, p+1, D]
            v = keys[:, 1].repeat_interleave(3, dim=1).transpose(0, 1)
            want = torch.softmax(q[b, :, t, None] @ k.transpose(1, 2) * DIM**-0.5, dim=-1) @ v  # [H, 1, D]
            torch.testing.assert_close(got[rows], want[:, 0], atol=ATOL, rtol=0)
            rows += 1


def test_each_device_has_a_default_kernel() -> None:
    assert default_kernel(torch.device("cpu")) is AttentionKernel.SDPA
    assert {type(make_attention(k)) for k in AttentionKernel} == {GatherAttention, SdpaAttention}


def test_model_logits_do_not_depend_on_the_kernel(target_model: LoadedModel) -> None:
    """Fresh prompts, then in one batch: a verify chunk after a prompt, the rest of a prompt
    after its first block (as a prefix-cache hit leaves it) and a decode."""
    runner = PagedLlama(target_model.model)
    text = "The quick brown fox jumps over the lazy dog because it was late for a very important meeting"
    prompt = target_model.tokenizer(text)["input_ids"]
    assert len(prompt) > 16
    logits = {}
    for kernel in AttentionKernel:
        runner.attention = make_attention(kernel)
        cache = runner.new_cache(token_budget=256)
        for slot in ("a", "b", "c"):
            cache.blocks.allocate(slot)
        first = runner.run(cache, [("a", prompt), ("b", prompt[:16]), ("c", prompt[:3])], logits="all")
        second = runner.run(cache, [("a", [11, 12, 13]), ("b", prompt[16:] + [5, 6]), ("c", [7])], logits="all")
        logits[kernel] = [*first, *second]
    # 1e-5 per layer, as above; through 30 layers, rounding grows to a few 1e-6 of the logits' scale.
    for got, want in zip(logits[AttentionKernel.SDPA], logits[AttentionKernel.GATHER]):
        torch.testing.assert_close(got, want, atol=ATOL * float(want.abs().max()), rtol=0)
