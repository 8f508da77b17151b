"""Small random models shared by the quantization tests (seeded, CPU, fp32)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(num_layers: int = 2) -> LlamaForCausalLM:
    """A Llama (2 layers by default) with GQA and tied embeddings, small enough to build in milliseconds."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).float().eval()
