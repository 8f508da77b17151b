"""Tests for int8 weight-only quantization: `Int8Linear` (both matmul paths) and `quantize_int8` on a tiny Llama."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specdec.model.quantize import Int8Linear, int8_matmul, int8pack_mm_supported, quantize_int8
from tests.support.tiny_models import tiny_llama

HAS_OP = hasattr(torch, "_weight_int8pack_mm")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_linear(in_features: int = 64, out_features: int = 96, *, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


# ---- Int8Linear -----------------------------------------------------------------------------


def test_from_linear_per_channel_scales() -> None:
    linear = make_linear()
    with torch.no_grad():
        linear.weight[3].mul_(100.0)  # one loud row must not affect the other rows' scales
        linear.weight[5].zero_()  # an all-zero row must not divide by zero
    q = Int8Linear.from_linear(linear)
    w = linear.weight.detach()
    assert q.weight_int8.dtype == torch.int8 and q.weight_int8.shape == (96, 64)
    assert q.scales.dtype == torch.float32 and q.scales.shape == (96,)
    torch.testing.assert_close(q.scales, w.abs().amax(dim=1) / 127)
    row_max = q.weight_int8.abs().amax(dim=1)  # [out]
    assert row_max[5] == 0 and q.scales[5] == 0
    assert torch.all(row_max[torch.arange(96) != 5] == 127)  # every live row uses the full range
    # Round-to-nearest: each dequantized weight is within half a step of the original.
    assert torch.all((q.dequantized_weight() - w).abs() <= q.scales[:, None] / 2 + 1e-7)


@pytest.mark.parametrize("fast", [False, pytest.param(True, marks=pytest.mark.skipif(not HAS_OP, reason="no op"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_paths_match_dequantized_reference(fast: bool, dtype: torch.dtype) -> None:
    q = Int8Linear.from_linear(make_linear()).to(dtype)
    torch.manual_seed(1)
    x = torch.randn(5, 64, dtype=dtype)  # [rows, in]
    ref = x.double() @ q.dequantized_weight().double().t()  # [rows, out]
    y = int8_matmul(x, q.weight_int8, q.scales, fast=fast)
    assert y.dtype == dtype and y.shape == (5, 96)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: output rounding (+ the fallback's rounding of x @ w)
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)


@pytest.mark.skipif(not HAS_OP, reason="torch._weight_int8pack_mm missing")
def test_fast_and_fallback_paths_agree() -> None:
    q = Int8Linear.from_linear(make_linear(576, 320))
    torch.manual_seed(2)
    x = torch.randn(7, 576)
    torch.testing.assert_close(
        int8_matmul(x, q.weight_int8, q.scales, fast=True),
        int8_matmul(x, q.weight_int8, q.scales, fast=False),
        rtol=1e-5, atol=1e-5,
    )
    # bf16: the fast kernel rounds once, the fallback rounds x @ w and then the product.
    xb, sb = x.bfloat16(), q.scales.bfloat16()
    fast = int8_matmul(xb, q.weight_int8, sb, fast=True).float()
    slow = int8_matmul(xb, q.weight_int8, sb, fast=False).float()
    torch.testing.assert_close(fast, slow, rtol=1.6e-2, atol=1e-2)


def test_fast_path_choice() -> None:
    assert not int8pack_mm_supported("cpu", torch.float32)  # scalar kernel there: slower than F.linear
    assert not int8pack_mm_supported("cuda", torch.bfloat16)
    if HAS_OP:
        assert int8pack_mm_supported("cpu", torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_leading_dims_bias_and_noncontiguous_input(dtype: torch.dtype) -> None:
    linear = make_linear(bias=True).to(dtype)
    q = Int8Linear.from_linear(linear)
    assert q.bias is not None and q.scales.dtype == dtype
    torch.manual_seed(3)
    x = torch.randn(2, 64, 3, dtype=dtype).transpose(1, 2)  # [2, 3, in], not contiguous in the last dim
    y = q(x)
    assert y.shape == (2, 3, 96) and y.dtype == dtype
    ref = (x.double() @ q.dequantized_weight().double().t() + linear.bias.double())  # [2, 3, out]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)
    assert q(torch.randn(64, dtype=dtype)).shape == (96,)  # a bare [in] vector works too


def test_quantization_error_is_small() -> None:
    linear = make_linear(576, 1536)
    q = Int8Linear.from_linear(linear)
    torch.manual_seed(4)
    x = torch.randn(16, 576)
    with torch.no_grad():
        ref = linear(x)
        rel = (q(x) - ref).norm() / ref.norm()
    assert rel < 0.02


def test_to_dtype_keeps_int8_weight() -> None:
    q = Int8Linear.from_linear(make_linear(bias=True)).to(torch.bfloat16)
    assert q.weight_int8.dtype == torch.int8
    assert q.scales.dtype == torch.bfloat16 and q.bias.dtype == torch.bfloat16
    assert set(q.state_dict()) == {"weight_int8", "scales", "bias"}


def test_rejects_bad_tensors() -> None:
    with pytest.raises(ValueError):
        Int8Linear(torch.zeros(4, 8), torch.ones(4))
    with pytest.raises(ValueError):
        Int8Linear(torch.zeros(4, 8, dtype=torch.int8), torch.ones(8))


# ---- quantize_int8 on a tiny Llama ----------------------------------------------------------


def test_quantize_int8_tiny_llama() -> None:
    model = tiny_llama()
    torch.manual_seed(5)
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        ref_logits = model(ids).logits  # [2, 24, vocab]
    embed_before = model.model.embed_tokens.weight.detach().clone()
    assert model.lm_head.weight is model.model.embed_tokens.weight

    assert quantize_int8(model) is model

    for layer in model.model.layers:
        for name in PROJECTIONS:
            module = getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)
            assert isinstance(module, Int8Linear), name
        assert isinstance(layer.input_layernorm.weight, nn.Parameter)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.model.embed_tokens, nn.Embedding)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    torch.testing.assert_close(model.model.embed_tokens.weight, embed_before, rtol=0, atol=0)
    assert isinstance(model.lm_head, Int8Linear)
    assert model.config.tie_word_embeddings is False
    assert model.config.specdec_quantization == "int8"

    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == ref_logits.shape and logits.dtype == torch.float32
    agreement = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    assert agreement >= 0.9, agreement
    # Untied for good: re-tying (as save/load would) leaves the int8 head alone.
    model.tie_weights()
    assert isinstance(model.lm_head, Int8Linear)
    torch.testing.assert_close(model(ids).logits, logits, rtol=0, atol=0)


def test_quantize_int8_can_keep_lm_head() -> None:
    model = quantize_int8(tiny_llama(), include_lm_head=False)
    assert isinstance(model.lm_head, nn.Linear)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert model.config.tie_word_embeddings is True
    assert isinstance(model.model.layers[0].mlp.down_proj, Int8Linear)


def test_quantized_llama_bf16_uses_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_llama().to(torch.bfloat16)
    torch.manual_seed(6)
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        ref_logits = model(ids).logits
    quantize_int8(model)
    assert model.lm_head.scales.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.q_proj.weight_int8.dtype == torch.int8

    calls = []
    if HAS_OP and int8pack_mm_supported("cpu", torch.bfloat16):
        op = torch._weight_int8pack_mm
        monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda *a: calls.append(1) or op(*a))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    if HAS_OP:
        assert len(calls) == 2 * len(PROJECTIONS) + 1  # every projection and the lm_head
    agreement = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    assert agreement >= 0.9, agreement
