"""K/V tensors of every layer, stored in fixed-size blocks, plus their block manager.

Each layer's keys and values are one tensor `[num_blocks * block_size + 1, 2, kv_heads, head_dim]`
(index 0 of the second dimension holds the key, 1 the value): the flat positions the block
manager hands out index its first dimension directly, so writing a token's key and value
is one `index_put_` and gathering a context is one `index_select`, on any device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import PretrainedConfig

from specdec.errors import InvalidArgumentError
from specdec.kv_cache.block_manager import BlockManager


class PagedKVCache:
    """The KV pool of one model: storage tensors and the block bookkeeping over them."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.blocks = BlockManager(num_blocks, block_size)
        self.dtype = dtype
        self.device = torch.device(device)
        #: A row past every block: where a fixed-shape step's padding tokens write their keys and
        #: values (`specdec.model.forward_batch.StepShape`), so every row of it writes somewhere.
        self.scratch_row = num_blocks * block_size
        shape = (num_blocks * block_size + 1, 2, num_kv_heads, head_dim)
        #: Per layer: [rows, 2 (key, value), kv_heads, head_dim], the scratch row last.
        self.kv: list[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def for_model(
        cls,
        config: PretrainedConfig,
        *,
        token_budget: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> PagedKVCache:
        """A pool holding at least `token_budget` tokens for a Llama-style `config`."""
        if token_budget <= 0:
            raise InvalidArgumentError(f"token_budget must be > 0, got {token_budget}", field="token_budget")
        if block_size <= 0:
            raise InvalidArgumentError(f"block_size must be > 0, got {block_size}", field="block_size")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            num_blocks=-(-token_budget // block_size),
            block_size=block_size,
            dtype=dtype,
            device=device,
        )

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    @property
    def capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.blocks.block_size

    def bytes_per_token(self) -> int:
        """Memory one cached token costs across all layers (keys and values)."""
        return self.kv[0][0].numel() * self.kv[0].element_size() * len(self.kv)

    def truncate(self, slot_id: str, new_len: int) -> None:
        """Roll a slot back to `new_len` tokens (`BlockManager.truncate_to`), copying the
        keys and values of a shared block it rolls back into to the slot's own new block."""
        bs = self.block_size
        for source, copy in self.blocks.truncate_to(slot_id, new_len):
            for kv in self.kv:
                kv[copy * bs : (copy + 1) * bs] = kv[source * bs : (source + 1) * bs]

    @contextmanager
    def temporary_slots(self, prefix: str, count: int) -> Iterator[list[str]]:
        """`count` empty slots named `prefix` + index, freed on exit whatever happened.

        For a service's own start-up measurements; `prefix` should start with a character
        no client slot id can hold (e.g. NUL) so that the two never meet.
        """
        slots = [f"{prefix}{i}" for i in range(count)]
        try:
            for slot in slots:
                self.blocks.allocate(slot)
            yield slots
        finally:
            for slot in slots:
                if self.blocks.has_slot(slot):
                    self.blocks.free(slot)
