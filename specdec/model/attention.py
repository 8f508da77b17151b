"""Attention of a chunk's queries over each request's context in the paged KV pool: one seam,
a kernel per `AttentionKernel`.

Every decoder layer writes its chunk's keys and values to its pool, then calls the model's
`PagedAttention` with its queries, those new keys and values, and the pool. What a kernel
needs from the batch's block tables (key rows, masks) is built once per forward by
`prepare` and shared by all layers, on the device, with no host synchronisation.

- `GATHER`, the reference: copies each request's context out of the pool into [B, L] rows
  and multiplies, materialising the scores [B, Hkv, G·T, L]. Each KV head's G query heads
  are stacked into one matrix, so no K/V is repeated.
- `SDPA`: torch's fused `scaled_dot_product_attention` (a flash kernel on CPU; flash or
  memory-efficient on CUDA), which never materialises the scores, with grouped-query heads
  handled by the kernel. Its causal mode skips the blocks above the diagonal, which an
  explicit mask cannot, so each batch takes the cheapest `ContextLayout` that is exact:
  a fresh batch (every chunk at position 0: a new prompt or its first piece) attends to
  its own new keys and reads nothing from the pool; a chunk that is most of its context
  (a prompt after a prefix-cache hit) has its queries placed at their positions and runs
  causal over the gathered context; any other (decode, verify, a late piece of a chunked
  prompt) gathers the context and passes the mask.

On CUDA, torch's memory-efficient kernel (the fused one that takes a mask) may refuse
grouped-query heads; the MASKED layout then runs torch's math path, whose scores for decode
and verify steps are small ([B, H, K + 1, L]). Which kernel pays there is for a GPU to measure.

For CUDA graphs: the key axis of `prepare`'s tensors is the block tables' width M times the
block size, never the longest context, so a decode or verify step whose block tables are
padded to a fixed width (a `StepShape` bucket, `specdec.model.cuda_graphs`) has the same
shapes at every step and `prepare` runs inside the captured graph; fresh batches are prompts
and run eager.
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from specdec.model.choices import AttentionKernel
from specdec.model.forward_batch import ForwardBatch

#: Each device type's kernel unless a flag chooses (docs/performance.md#attention-kernels).
DEFAULT_KERNELS = {"cpu": AttentionKernel.SDPA, "cuda": AttentionKernel.SDPA}


def default_kernel(device: torch.device) -> AttentionKernel:
    """The kernel `device` runs by default (SDPA where no default is set: it runs everywhere)."""
    return DEFAULT_KERNELS.get(device.type, AttentionKernel.SDPA)


def attention_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for the attention math on CPU, where a CPU without native bf16 units runs a bf16
    batched matmul several times slower and the tensors are small; on accelerators the
    model's own dtype."""
    return torch.float32 if x.device.type == "cpu" else x.dtype


class ContextLayout(enum.Enum):
    """How a batch's queries meet their keys (`SdpaAttention.prepare` chooses; GATHER is always MASKED)."""

    #: Every chunk starts at position 0: causal over the chunk's own keys, nothing read from the pool.
    OWN_KEYS = "own keys"
    #: Queries placed at their positions in [B, L] (zeros elsewhere), causal over the gathered context.
    ALIGNED = "aligned"
    #: Queries as they come, an explicit mask over the gathered context.
    MASKED = "masked"


class AttentionInputs(NamedTuple):
    """What every layer's attention reads besides its own queries, keys, values and pool
    (B requests, T = longest chunk, n real tokens, L = key positions: block-table width ×
    block size). A field its layout does not read is an empty tensor."""

    layout: ContextLayout
    context_index: torch.Tensor  # [B, L] pool row of each key position (ALIGNED, MASKED)
    bias: torch.Tensor  # [B, 1, Q, L] 0 where a query sees a key, -inf elsewhere; Q = T, or G·T for GATHER (MASKED)
    token_rows: torch.Tensor  # [n] index of each real query in the flattened [B*T] (ALIGNED)
    query_slots: torch.Tensor  # [n] row of each real query in the flattened [B*L]: b·L + its position (ALIGNED)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors its layout reads."""
        if self.layout is ContextLayout.OWN_KEYS:
            return ()
        if self.layout is ContextLayout.ALIGNED:
            return self.context_index, self.token_rows, self.query_slots
        return self.context_index, self.bias


class PagedAttention(Protocol):
    """Attention of a chunk's queries over their requests' contexts in one layer's pool."""

    kernel: AttentionKernel

    def prepare(self, batch: ForwardBatch, groups: int, dtype: torch.dtype) -> AttentionInputs:
        """The per-forward inputs for a model with `groups` query heads per KV head, masks in `dtype`."""
        ...

    def __call__(
        self,
        q: torch.Tensor,  # [B, H, T, D] the chunk's queries, RoPE applied
        new_kv: torch.Tensor,  # [B, T, 2, Hkv, D] the chunk's keys (RoPE applied) and values, already in `kv`
        kv: torch.Tensor,  # [rows, 2, Hkv, D] the layer's pool
        inputs: AttentionInputs,
    ) -> torch.Tensor:  # [B, H, T, D]
        ...


def context_rows(batch: ForwardBatch) -> torch.Tensor:
    """Pool row of each key position of each request, from its block table. # [B, L]"""
    bs = batch.block_size
    offsets = torch.arange(bs, device=batch.block_tables.device)  # [bs]
    return (batch.block_tables[:, :, None] * bs + offsets).flatten(1)  # [B, M·bs]


def context_bias(batch: ForwardBatch, dtype: torch.dtype) -> torch.Tensor:
    """0 where a query sees a key, -inf elsewhere: causal inside the chunk, everything cached
    before it, nothing past the context (so a padding query still sees keys). # [B, 1, T, L]"""
    key_pos = torch.arange(batch.block_tables.shape[1] * batch.block_size, device=batch.positions.device)  # [L]
    visible = (key_pos[None, None, :] <= batch.positions[:, :, None]) & (
        key_pos[None, None, :] < batch.context_lens[:, None, None]
    )  # [B, T, L]
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return bias.masked_fill(~visible, float("-inf"))[:, None]


def gather_context(kv: torch.Tensor, context_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of each request's context, copied out of the pool. # [B, Hkv, L, D] each"""
    bsz = context_index.shape[0]
    context = kv.index_select(0, context_index.view(-1)).view(bsz, -1, *kv.shape[1:])  # [B, L, 2, Hkv, D]
    return context[:, :, 0].transpose(1, 2), context[:, :, 1].transpose(1, 2)


class GatherAttention:
    """The reference: gathered context, scores materialised. Keys are gathered as [L, D] rows
    and multiplied transposed: gathered straight into a [D, L] layout, the compiled kernel read
    the pool element by element (docs/performance.md#attention-on-cpu)."""

    kernel = AttentionKernel.GATHER

    def prepare(self, batch: ForwardBatch, groups: int, dtype: torch.dtype) -> AttentionInputs:
        bias = context_bias(batch, dtype).repeat(1, 1, groups, 1)  # [B, 1, G·T, L]: the stacked heads of a group
        return AttentionInputs(ContextLayout.MASKED, context_rows(batch), bias, _unused(batch), _unused(batch))

    def __call__(
        self, q: torch.Tensor, new_kv: torch.Tensor, kv: torch.Tensor, inputs: AttentionInputs
    ) -> torch.Tensor:
        bsz, heads, width, dim = q.shape
        k_ctx, v_ctx = gather_context(kv, inputs.context_index)  # [B, Hkv, L, D] each
        math = attention_dtype(q)
        stacked = q.reshape(bsz, kv.shape[2], -1, dim).to(math)  # [B, Hkv, G·T, D]: head h = g_kv · G + g
        scores = torch.matmul(stacked, k_ctx.to(math).transpose(2, 3)) * dim**-0.5 + inputs.bias  # [B, Hkv, G·T, L]
        out = torch.matmul(torch.softmax(scores, dim=-1), v_ctx.to(math))  # [B, Hkv, G·T, D]
        return out.to(q.dtype).view(bsz, heads, width, dim)


class SdpaAttention:
    """Fused attention, scores never materialised, in the cheapest exact `ContextLayout`."""

    kernel = AttentionKernel.SDPA

    def prepare(self, batch: ForwardBatch, groups: int, dtype: torch.dtype) -> AttentionInputs:
        """A causal pass over L key positions per request costs about L²/2 query-key pairs, a
        masked one T·L: so ALIGNED where T > L / 2. Decided from shapes, on the host."""
        none = _unused(batch)
        if batch.fresh:
            return AttentionInputs(ContextLayout.OWN_KEYS, none, none, none, none)
        width, length = batch.positions.shape[1], batch.block_tables.shape[1] * batch.block_size
        if 2 * width > length:
            request = torch.arange(batch.positions.shape[0], device=batch.positions.device)  # [B]
            slots = (request[:, None] * length + batch.positions).flatten()  # [B*T]
            return AttentionInputs(ContextLayout.ALIGNED, context_rows(batch), none, batch.token_rows,
                                   slots.index_select(0, batch.token_rows))
        return AttentionInputs(ContextLayout.MASKED, context_rows(batch), context_bias(batch, dtype), none, none)

    def __call__(
        self, q: torch.Tensor, new_kv: torch.Tensor, kv: torch.Tensor, inputs: AttentionInputs
    ) -> torch.Tensor:
        math = attention_dtype(q)
        if inputs.layout is ContextLayout.OWN_KEYS:
            # A padding query attends padding keys after the real ones: garbage nobody reads,
            # while every real query sees only real keys.
            keys, values = new_kv[:, :, 0].transpose(1, 2), new_kv[:, :, 1].transpose(1, 2)  # [B, Hkv, T, D] each
            out = F.scaled_dot_product_attention(
                q.to(math), keys.to(math), values.to(math), is_causal=True, enable_gqa=True
            )
            return out.to(q.dtype)  # [B, H, T, D]
        keys, values = gather_context(kv, inputs.context_index)  # [B, Hkv, L, D] each
        if inputs.layout is ContextLayout.ALIGNED:
            return _aligned(q.to(math), keys.to(math), values.to(math), inputs).to(q.dtype)
        out = F.scaled_dot_product_attention(
            q.to(math), keys.to(math), values.to(math), attn_mask=inputs.bias, enable_gqa=True
        )
        return out.to(q.dtype)  # [B, H, T, D]


def _aligned(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
    """Causal attention with each real query at its own position among L: a query at position p
    sees keys 0..p, exactly its context. The other L rows are zeros, computed and dropped;
    padding queries come back as zeros. # [B, H, T, D]"""
    bsz, heads, width, dim = q.shape
    length = keys.shape[2]
    real = q.transpose(1, 2).reshape(bsz * width, heads, dim).index_select(0, inputs.token_rows)  # [n, H, D]
    placed = q.new_zeros(bsz * length, heads, dim).index_copy_(0, inputs.query_slots, real)  # [B*L, H, D]
    placed = placed.view(bsz, length, heads, dim).transpose(1, 2)  # [B, H, L, D]
    out = F.scaled_dot_product_attention(placed, keys, values, is_causal=True, enable_gqa=True)  # [B, H, L, D]
    answers = out.transpose(1, 2).reshape(bsz * length, heads, dim).index_select(0, inputs.query_slots)  # [n, H, D]
    result = q.new_zeros(bsz * width, heads, dim).index_copy_(0, inputs.token_rows, answers)  # [B*T, H, D]
    return result.view(bsz, width, heads, dim).transpose(1, 2)


def _unused(batch: ForwardBatch) -> torch.Tensor:
    """The empty tensor standing for a field a layout does not read."""
    return batch.last_rows[:0]


KERNELS: dict[AttentionKernel, type[GatherAttention] | type[SdpaAttention]] = {
    AttentionKernel.GATHER: GatherAttention,
    AttentionKernel.SDPA: SdpaAttention,
}


def make_attention(kernel: AttentionKernel) -> PagedAttention:
    return KERNELS[kernel]()
