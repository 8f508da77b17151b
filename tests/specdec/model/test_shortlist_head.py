"""Tests for `ShortlistHead`: a 4-bit pass over the vocabulary, the int8 head on its best tokens."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specdec.model.int4_weight import Int4Weight
from specdec.model.loader import LoadedModel
from specdec.model.quantize import Int8Linear
from specdec.model.quantize_int4 import Int4Linear
from specdec.model.shortlist_head import ShortlistHead

TEXT = (
    "The quick brown fox jumps over the lazy dog because it wanted to see what was on the other side. "
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    "Translate to French: I would like a cup of coffee, please."
)


def int8_head(out: int = 512, in_features: int = 64, *, seed: int = 0) -> Int8Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out, bias=False).to(torch.bfloat16)
    return Int8Linear.from_linear(linear)


def test_shortlisted_logits_are_the_exact_heads_and_the_rest_the_coarse_pass() -> None:
    exact = int8_head()
    head = ShortlistHead.from_int8(exact, shortlist=16)
    x = torch.randn(3, 5, 64).to(torch.bfloat16)  # [batch, tokens, in]
    got = head(x)  # [batch, tokens, out]
    assert got.shape == (3, 5, 512) and got.dtype == torch.bfloat16
    want_exact = exact(x).float()  # [batch, tokens, out]
    coarse = head.coarse(x).float()  # [batch, tokens, out]
    picked = coarse.topk(16, dim=-1).indices  # [batch, tokens, 16]
    on_list = torch.zeros_like(coarse, dtype=torch.bool).scatter_(-1, picked, True)
    torch.testing.assert_close(got.float()[on_list], want_exact[on_list], rtol=1e-2, atol=1e-2)
    assert torch.equal(got.float()[~on_list], coarse[~on_list])
    # The coarse pass ranks well enough that the exact winner is on the list: same argmax.
    assert torch.equal(got.float().argmax(-1), want_exact.argmax(-1))


def test_a_shortlist_of_the_whole_vocabulary_is_the_exact_head() -> None:
    exact = int8_head(out=64)
    x = torch.randn(4, 64).to(torch.bfloat16)  # [rows, in]
    shortlisted = ShortlistHead.from_int8(exact, shortlist=64)(x).float()
    torch.testing.assert_close(shortlisted, exact(x).float(), rtol=1e-2, atol=1e-2)


def test_rejects_bad_heads() -> None:
    exact = int8_head(out=64)
    coarse = Int4Linear(Int4Weight.from_float(exact.dequantized_weight().float(), 32))
    for shortlist in (0, 65):
        with pytest.raises(ValueError, match="shortlist"):
            ShortlistHead(exact, coarse, shortlist)
    with pytest.raises(ValueError, match="coarse head"):
        ShortlistHead(int8_head(out=128), coarse, 8)
    biased = Int8Linear(exact.weight_int8, exact.scales, torch.zeros(64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        ShortlistHead(biased, coarse, 8)


def test_real_head_agrees_with_the_int8_head(target_model: LoadedModel) -> None:
    """On SmolLM2's own 49,152-token head and hidden states, the shortlist head picks the int8
    head's token at every position (teacher-forced), where the 4-bit pass alone does not."""
    weight = target_model.model.lm_head.weight.detach().to(torch.bfloat16)  # [vocab, hidden]
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=torch.bfloat16)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    exact = Int8Linear.from_linear(linear)
    head = ShortlistHead.from_int8(exact)
    ids = target_model.tokenizer(TEXT, return_tensors="pt").input_ids  # [1, tokens]
    with torch.inference_mode():
        hidden = target_model.model.model(ids).last_hidden_state[0].to(torch.bfloat16)  # [tokens, hidden]
        want = exact(hidden).float().argmax(-1)  # [tokens]
        got = head(hidden).float().argmax(-1)
        coarse = head.coarse(hidden).float().argmax(-1)
    assert ids.shape[1] >= 60
    assert torch.equal(got, want)
    assert (coarse != want).any()  # the test can tell a shortlist from the coarse pass alone
