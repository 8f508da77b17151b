"""Our Llama forward pass over a paged KV cache.

The weights are the ones `transformers` loaded (possibly with projections swapped for
int8 modules by `specdec.model.quantize`); the computation is ours so that one batched
call can mix prefills, verify chunks and single-token decodes, each request at its own
position, with keys and values living in the paged pool. Covers Llama 3.x (incl. the
`llama3` RoPE scaling, via the rotary inverse frequencies `transformers` computed), GQA,
tied embeddings and SmolLM2. Device-agnostic: nothing here names a device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specdec.errors import InvalidArgumentError
from specdec.kv_cache.paged_cache import PagedKVCache
from specdec.model.forward_batch import ForwardBatch, build_forward_batch

SUPPORTED_MODEL_TYPES = ("llama",)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back, as Llama does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PagedLlama:
    """Runs a loaded Llama `transformers` model over a `PagedKVCache`."""

    def __init__(self, model: PreTrainedModel) -> None:
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise InvalidArgumentError(f"model type {config.model_type!r} is not supported (need one of {SUPPORTED_MODEL_TYPES})")
        self.model = model
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.eps = config.rms_norm_eps
        decoder = model.model
        self.embed_tokens = decoder.embed_tokens
        self.layers = decoder.layers
        self.final_norm = decoder.norm
        self.lm_head = model.lm_head
        # inv_freq already carries the `llama3` (or linear, ...) rescaling of the config.
        self.inv_freq: torch.Tensor = decoder.rotary_emb.inv_freq  # [head_dim / 2]
        self.attention_scaling: float = float(decoder.rotary_emb.attention_scaling)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, *, token_budget: int, block_size: int = 16) -> PagedKVCache:
        """A KV pool sized for this model, in its dtype and on its device."""
        return PagedKVCache.for_model(
            self.config, token_budget=token_budget, block_size=block_size,
            dtype=self.dtype, device=self.embed_tokens.weight.device,
        )

    @torch.inference_mode()
    def run(self, cache: PagedKVCache, chunks: list[tuple[str, list[int]]], logits: str = "last") -> list[torch.Tensor]:
        """Append each (slot, tokens) chunk to the cache in one batched forward pass.

        Returns one logits tensor per chunk: `[vocab]` for `logits="last"`, `[len(tokens), vocab]`
        for `logits="all"`. Slots must exist and already be truncated to the chunk's start.
        """
        batch = build_forward_batch(cache, chunks)
        rows = batch.flat_rows(logits)
        out = self.forward(batch, cache, rows)  # [n_rows, vocab]
        if logits == "last":
            return list(out.unbind(0))
        return list(out.split(batch.chunk_lens, dim=0))

    def forward(self, batch: ForwardBatch, cache: PagedKVCache, logit_rows: torch.Tensor) -> torch.Tensor:
        """Logits `[len(logit_rows), vocab]` for the given rows of the flattened `[B*T]` batch."""
        bsz, width = batch.input_ids.shape
        hidden = self.embed_tokens(batch.input_ids)  # [B, T, hidden]
        cos, sin = self._rope(batch.positions, hidden.dtype)  # [B, 1, T, head_dim] each
        for index, layer in enumerate(self.layers):
            attn_in = rms_norm(hidden, layer.input_layernorm.weight, self.eps)
            hidden = hidden + self._attention(layer.self_attn, attn_in, cos, sin, batch, cache, index)
            mlp_in = rms_norm(hidden, layer.post_attention_layernorm.weight, self.eps)
            hidden = hidden + self._mlp(layer.mlp, mlp_in)
        hidden = rms_norm(hidden, self.final_norm.weight, self.eps)
        selected = hidden.reshape(bsz * width, -1).index_select(0, logit_rows)  # [n_rows, hidden]
        return self.lm_head(selected)  # [n_rows, vocab]

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.float()  # [B, T, head_dim / 2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [B, T, head_dim]
        cos = (angles.cos() * self.attention_scaling).to(dtype)
        sin = (angles.sin() * self.attention_scaling).to(dtype)
        return cos[:, None], sin[:, None]

    def _attention(
        self,
        attn: torch.nn.Module,
        x: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        cache: PagedKVCache,
        layer_index: int,
    ) -> torch.Tensor:
        bsz, width, _ = x.shape
        q = attn.q_proj(x).view(bsz, width, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = attn.k_proj(x).view(bsz, width, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = attn.v_proj(x).view(bsz, width, self.num_kv_heads, self.head_dim)  # [B, T, Hkv, D]
        q = q * cos + rotate_half(q) * sin
        k = (k * cos + rotate_half(k) * sin).transpose(1, 2)  # [B, T, Hkv, D]

        keys, values = cache.keys[layer_index], cache.values[layer_index]  # [rows, Hkv, D]
        keys.index_copy_(0, batch.write_index, k[batch.token_mask])
        values.index_copy_(0, batch.write_index, v[batch.token_mask])
        context = batch.context_index.reshape(-1)  # [B*L]
        ctx_len = batch.context_index.shape[1]
        k_ctx = keys.index_select(0, context).view(bsz, ctx_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v_ctx = values.index_select(0, context).view(bsz, ctx_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, k_ctx, v_ctx, attn_mask=batch.attn_mask, enable_gqa=self.num_kv_heads != self.num_heads
        )  # [B, H, T, D]
        return attn.o_proj(out.transpose(1, 2).reshape(bsz, width, self.num_heads * self.head_dim))

    @staticmethod
    def _mlp(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU: down(silu(gate(x)) * up(x))."""
        return mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
