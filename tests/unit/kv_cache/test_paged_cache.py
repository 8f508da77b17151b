"""The paged KV pool's tensors on `--device`: allocated there, block tables built there, and a
rollback into a shared block copying its keys and values there."""

from __future__ import annotations

import pytest
import torch

from specdec.kv_cache.paged_cache import PagedKVCache
from specdec.model.forward_batch import build_forward_batch
from tests.support.block_pool import check_pool

pytestmark = pytest.mark.device_agnostic
BLOCK = 4


def _pool(device: torch.device, dtype: torch.dtype = torch.float32) -> PagedKVCache:
    return PagedKVCache(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=6, block_size=BLOCK, dtype=dtype,
                        device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pool_and_its_block_tables_live_on_the_device(device: torch.device, dtype: torch.dtype) -> None:
    cache = _pool(device, dtype)
    rows = 6 * BLOCK + 1  # the scratch row last
    assert all(kv.device == device and kv.dtype == dtype and kv.shape == (rows, 2, 2, 8) for kv in cache.kv)
    assert cache.bytes_per_token() == 2 * 2 * 8 * 2 * dtype.itemsize  # (key, value) x heads x dim x layers
    for slot, tokens in (("a", 9), ("b", 3)):
        cache.blocks.allocate(slot)
        cache.blocks.append(slot, tokens)
    tables = build_forward_batch(cache, [("a", [1] * 9), ("b", [1] * 3)]).block_tables  # [2, max_blocks]
    assert tables.device == device and tables.tolist() == [cache.blocks.block_table("a"),
                                                            cache.blocks.block_table("b") + [0, 0]]


def test_rolling_back_into_a_shared_block_copies_its_keys_and_values_on_the_device(device: torch.device) -> None:
    cache = _pool(device)
    tokens = list(range(10))
    cache.blocks.allocate("a")
    cache.blocks.append("a", len(tokens))
    for layer, kv in enumerate(cache.kv):  # what a forward would have written: a value per row
        kv.copy_(torch.arange(kv.shape[0], device=device, dtype=kv.dtype)[:, None, None, None] + 100 * layer)
    cache.blocks.register_full_blocks("a", tokens)
    cache.blocks.allocate("b", cache.blocks.cached_prefix(tokens))  # shares a's two full blocks
    shared = cache.blocks.block_table("a")[1]
    cache.truncate("b", 6)  # inside the shared second block: b gets its own copy
    own = cache.blocks.block_table("b")[1]
    assert own != shared and cache.blocks.block_table("a")[1] == shared
    for kv in cache.kv:
        assert torch.equal(kv[own * BLOCK : (own + 1) * BLOCK], kv[shared * BLOCK : (shared + 1) * BLOCK])
    check_pool(cache.blocks, "ab")
