"""Fixed-shape steps (`PagedLlama.compute_fixed`): a token's logits and cached keys and values
are the same bits whether it was decoded alone, beside another request, or verified inside a
(K+1)-token chunk, in every dtype. That is what makes greedy speculative output equal plain
output in bf16, where the ordinary path's kernels round differently for different shapes."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.errors import InvalidArgumentError
from specdec.kv_cache.paged_cache import PagedKVCache
from specdec.model.attention import AttentionKernel, make_attention
from specdec.model.forward_batch import StepShape
from specdec.model.llama import PagedLlama

SHAPE = StepShape(requests=2, tokens=5, blocks=8)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84]
DRAFT = [7, 11, 13, 17, 19]
#: On every core even under xdist: the invariance must hold for the multi-threaded kernels.
pytestmark = pytest.mark.usefixtures("every_core")


def _model(device: torch.device, dtype: torch.dtype, kernel: AttentionKernel) -> PagedLlama:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
    )
    forward = PagedLlama(LlamaForCausalLM(config).to(device=device, dtype=dtype).eval())
    forward.attention = make_attention(kernel)
    return forward


def _step(
    forward: PagedLlama, cache: PagedKVCache, chunks: list[tuple[str, list[int]]], shape: StepShape = SHAPE
) -> list[torch.Tensor]:
    cache.blocks.append_many([(slot_id, len(tokens)) for slot_id, tokens in chunks])
    return forward.compute_fixed(cache, chunks, shape)


def _kv_rows(cache: PagedKVCache, slot_id: str, start: int, end: int) -> list[torch.Tensor]:
    rows = torch.tensor(cache.blocks.positions(slot_id, start, end), device=cache.device)
    return [layer.index_select(0, rows) for layer in cache.kv]


@pytest.mark.device_agnostic
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kernel", list(AttentionKernel), ids=lambda kernel: kernel.value)
def test_verified_tokens_equal_decoded_tokens_bit_for_bit(
    device: torch.device, dtype: torch.dtype, kernel: AttentionKernel
) -> None:
    forward = _model(device, dtype, kernel)
    shape = forward.fixed_shape(SHAPE.requests, SHAPE.tokens, SHAPE.blocks)  # widened where rows would differ
    assert shape is not None
    cache = forward.new_cache(token_budget=SHAPE.blocks * 16 * 4)
    for slot_id, prompt in (("plain", PROMPT), ("spec", PROMPT), ("other", PROMPT[::-1])):
        cache.blocks.allocate(slot_id)
        forward.run(cache, [(slot_id, prompt)])  # one request per prefill: the same bits for plain and spec
    decoded = []
    for step, token in enumerate(DRAFT):  # alone, then as the second row beside another request
        chunks = [("plain", [token])] if step % 2 == 0 else [("other", [step]), ("plain", [token])]
        decoded.append(_step(forward, cache, chunks, shape)[-1])
    verified = _step(forward, cache, [("other", [1, 2]), ("spec", DRAFT)], shape)[-1]  # [K+1, vocab]
    assert torch.equal(verified, torch.cat(decoded))
    end = len(PROMPT) + len(DRAFT)
    for spec_rows, plain_rows in zip(_kv_rows(cache, "spec", 0, end), _kv_rows(cache, "plain", 0, end)):
        assert torch.equal(spec_rows, plain_rows)


@pytest.mark.device_agnostic
def test_fixed_steps_give_the_ordinary_logits(device: torch.device) -> None:
    forward = _model(device, torch.float32, AttentionKernel.GATHER)
    cache = forward.new_cache(token_budget=SHAPE.blocks * 16 * 4)
    for slot_id in ("fixed", "ordinary"):
        cache.blocks.allocate(slot_id)
        forward.run(cache, [(slot_id, PROMPT)])
    chunks = [("fixed", DRAFT), ("ordinary", DRAFT)]
    fixed = _step(forward, cache, chunks[:1])[0]
    ordinary = forward.run(cache, chunks[1:], logits="all", prompt=False)[0]
    torch.testing.assert_close(fixed, ordinary, rtol=0, atol=1e-5)


def test_a_fixed_shape_is_as_wide_as_asked_or_wider_where_rows_would_differ() -> None:
    forward = _model(torch.device("cpu"), torch.float32, AttentionKernel.GATHER)
    shape = forward.fixed_shape(SHAPE.requests, SHAPE.tokens, SHAPE.blocks)
    assert shape is not None and (shape.requests, shape.blocks) == (SHAPE.requests, SHAPE.blocks)
    assert SHAPE.tokens <= shape.tokens <= 2 * SHAPE.tokens
    assert forward.rows_invariant(shape.requests * shape.tokens)
    assert forward.fixed_shape(1, 1, 4) == StepShape(1, 1, 4)  # one row sits in one place


def test_chunks_that_do_not_fit_the_shape_are_refused() -> None:
    forward = _model(torch.device("cpu"), torch.float32, AttentionKernel.GATHER)
    cache = forward.new_cache(token_budget=SHAPE.blocks * 16 * 4)
    cache.blocks.allocate("a")
    forward.run(cache, [("a", PROMPT)])
    with pytest.raises(InvalidArgumentError, match="do not fit"):
        _step(forward, cache, [("a", DRAFT + [1])])
    cache.truncate("a", len(PROMPT))
    long_prompt = PROMPT * 7  # past SHAPE.blocks blocks of 16
    cache.blocks.allocate("b")
    forward.run(cache, [("b", long_prompt)])
    with pytest.raises(InvalidArgumentError, match="more than the step's"):
        _step(forward, cache, [("b", [1])])
