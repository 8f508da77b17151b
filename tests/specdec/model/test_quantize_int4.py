"""Tests for 4-bit group-wise quantization: `Int4Weight`, both `Int4Linear` kernels, GGUF Q4 blocks
and `quantize_int4` on a tiny and on the real embedded Llama."""

from __future__ import annotations

import copy
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import quants
from torch import nn
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from specdec.errors import InvalidArgumentError
from specdec.model import gguf_q4, int4_dot
from specdec.model import quantize_int4 as qi4
from specdec.model.choices import DEFAULT_MODEL, INT4_KERNELS
from specdec.model.gguf_q4 import gguf_int4_weights, read_gguf_int4_weights, rope_unpermute_rows
from specdec.model.int4_weight import Int4Weight
from specdec.model.linear import MAX_NARROW_ROWS
from specdec.model.loader import LoadedModel, embedded_model_path
from specdec.model.quantize_int4 import Int4Linear, default_int4_kernel, quantize_int4
from tests.support.tiny_models import tiny_llama

HAS_OP = hasattr(torch, "_weight_int4pack_mm_for_cpu")
KERNELS = [
    "dequant",
    pytest.param("int4pack", marks=pytest.mark.skipif(not HAS_OP, reason="no int4pack op")),
    pytest.param("int4dot", marks=pytest.mark.skipif(not int4_dot.available(),
                                                   reason="int4dot needs AVX-512 BF16 or AVX2")),
]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [
    "The quick brown fox jumps over the lazy dog because",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Translate to French: I would like a cup of coffee, please.",
]


def random_weight(out: int = 96, in_features: int = 128, *, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(out, in_features) * 0.05  # [out, in]


# ---- Int4Weight -------------------------------------------------------------------------------


def test_from_float_round_trip_within_half_a_step() -> None:
    w = random_weight()
    w[3, :32] *= 100.0  # one loud group must not affect its neighbours
    w[5, 32:64] = 0.25  # a constant group must not divide by zero
    q = Int4Weight.from_float(w, group_size=32)
    assert q.q.dtype == torch.uint8 and q.q.shape == (96, 128)
    assert q.scales.shape == q.zeros.shape == (96, 4) and q.scales.dtype == torch.float32
    assert int(q.q.max()) == 15 and int(q.q.min()) == 0
    assert q.scales[5, 1] == 0 and q.zeros[5, 1] == 0.25
    torch.testing.assert_close(q.scales[3, 1], (w[3, 32:64].max() - w[3, 32:64].min()) / 15)
    assert q.scales[3, 0] > 50 * q.scales[3, 1]
    step = q.scales.repeat_interleave(32, dim=1)  # [out, in]
    err = (q.dequantize() - w).abs()  # [out, in]
    assert torch.all(err <= step / 2 + 1e-6), (err - step / 2).max()
    assert torch.all(q.dequantize()[5, 32:64] == 0.25)
    # Each group's min and max are hit exactly (up to float rounding): min/max quantization.
    deq = q.dequantize().reshape(96, 4, 32)
    torch.testing.assert_close(deq.amin(-1), w.reshape(96, 4, 32).amin(-1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(deq.amax(-1), w.reshape(96, 4, 32).amax(-1), rtol=1e-6, atol=1e-6)


def test_concat_stacks_output_rows() -> None:
    parts = [Int4Weight.from_float(random_weight(out, 64, seed=out), 32) for out in (32, 16, 48)]
    fused = Int4Weight.concat(parts)
    assert fused.q.shape == (96, 64) and fused.scales.shape == (96, 2) and fused.group_size == 32
    torch.testing.assert_close(fused.dequantize(), torch.cat([p.dequantize() for p in parts]), rtol=0, atol=0)
    # A fused Int4Linear equals the separate layers side by side.
    x = torch.randn(3, 64)  # [rows, in]
    separate = torch.cat([Int4Linear(p, kernel="dequant")(x) for p in parts], dim=-1)  # [rows, 96]
    torch.testing.assert_close(Int4Linear(fused, kernel="dequant")(x), separate)
    modules = [Int4Linear(p, torch.randn(p.out_features), source="gguf") for p in parts]
    fused_module = Int4Linear.concat(modules)
    assert fused_module.out_features == 96 and fused_module.source == "gguf"
    torch.testing.assert_close(fused_module(x), torch.cat([m(x) for m in modules], dim=-1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        Int4Weight.concat([parts[0], Int4Weight.from_float(random_weight(32, 64), 64)])
    with pytest.raises(ValueError):
        Int4Weight.concat([parts[0], Int4Weight.from_float(random_weight(32, 128), 32)])
    with pytest.raises(ValueError):
        Int4Weight.concat([])


def test_rejects_bad_tensors() -> None:
    ok = Int4Weight.from_float(random_weight(16, 64), 32)
    with pytest.raises(ValueError):
        Int4Weight(ok.q.to(torch.int32), ok.scales, ok.zeros, 32)
    with pytest.raises(ValueError):
        Int4Weight(ok.q | 0x10, ok.scales, ok.zeros, 32)  # not a 4-bit code
    with pytest.raises(ValueError):
        Int4Weight(ok.q, ok.scales.half(), ok.zeros, 32)
    with pytest.raises(ValueError):
        Int4Weight(ok.q, ok.scales, ok.zeros, 64)  # scales do not match the group size
    with pytest.raises(ValueError):
        Int4Weight.from_float(random_weight(16, 48), 32)  # 48 is not a multiple of 32
    with pytest.raises(ValueError):
        Int4Weight.from_float(torch.ones(64), 32)
    with pytest.raises(ValueError):
        Int4Linear(ok, kernel="fast")
    with pytest.raises(ValueError):
        Int4Linear(ok, torch.zeros(8))


# ---- Int4Linear kernels -----------------------------------------------------------------------


def test_int4pack_kernel_convention() -> None:
    """The packed kernel computes (q - 8) * s + z: with our offset mapping it equals x @ dequantize().T."""
    if not HAS_OP:
        pytest.skip("no int4pack op")
    weight = Int4Weight.from_float(random_weight(64, 128) + 0.3, 32)  # zeros far from 0: offset mistakes show
    packed, scales_and_zeros = qi4.int4pack_operands(weight, torch.float32)
    assert scales_and_zeros.shape == (4, 64, 2)  # [groups, out, 2]
    eye = torch.eye(128)  # [in, in]: the kernel's output is then the dequantized weight itself
    got = torch._weight_int4pack_mm_for_cpu(eye, packed, 32, scales_and_zeros).t()  # [out, in]
    torch.testing.assert_close(got, weight.dequantize(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_dequantized_reference(kernel: str, dtype: torch.dtype) -> None:
    if kernel == "int4dot" and dtype != torch.bfloat16:
        pytest.skip("int4dot takes bfloat16 activations only")
    weight = Int4Weight.from_float(random_weight(128, 256) + 0.1, 32)
    bias = torch.randn(128)
    module = Int4Linear(weight, bias.to(dtype), kernel=kernel)
    torch.manual_seed(1)
    x = torch.randn(2, 256, 3, dtype=dtype).transpose(1, 2)  # [2, 3, in], not contiguous in the last dim
    y = module(x)
    assert module.kernel == kernel and y.shape == (2, 3, 128) and y.dtype == dtype
    ref = x.double() @ weight.dequantize().double().t() + bias.to(dtype).double()  # [2, 3, out]
    # bf16: x, the weight (or the kernel's scales and offsets) and the output are rounded.
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)
    assert module(torch.randn(256, dtype=dtype)).shape == (128,)  # a bare [in] vector works too


def test_auto_kernel_takes_the_preferred_one_and_falls_back_by_shape() -> None:
    weight = Int4Weight.from_float(random_weight(128, 64), 32)
    module = Int4Linear(weight)
    assert module.kernel == ""  # chosen on first use
    assert module.prepare("cpu", torch.bfloat16) == default_int4_kernel("cpu", torch.bfloat16)  # nothing measured
    assert Int4Linear(weight, prefer="dequant").prepare("cpu", torch.bfloat16) == "dequant"
    odd = Int4Linear(Int4Weight.from_float(random_weight(24, 64), 32))  # 24 rows: int4pack needs out % 16 == 0
    assert odd.prepare("cpu", torch.bfloat16) == "dequant"
    if HAS_OP and default_int4_kernel("cpu", torch.bfloat16) == "int4dot":  # 96 rows: int4dot needs out % 64 == 0
        assert Int4Linear(Int4Weight.from_float(random_weight(96, 64), 32)).prepare("cpu", torch.bfloat16) == "int4pack"
    with pytest.raises(ValueError):
        Int4Linear(odd.int4_weight(), kernel="int4pack")
    with pytest.raises(ValueError, match="prefer"):
        Int4Linear(weight, prefer="fast")
    assert default_int4_kernel("cuda", torch.bfloat16) == "dequant"  # no CPU kernel off CPU
    fused = Int4Linear.concat([Int4Linear(weight, prefer="dequant"), Int4Linear(weight, prefer="dequant")])
    assert fused.prefer == "dequant"


def test_wide_inputs_take_the_wide_kernel() -> None:
    if not HAS_OP:
        pytest.skip("no int4pack op")
    weight = Int4Weight.from_float(random_weight(64, 64) + 0.1, 32)
    narrow_only = Int4Linear(weight, kernel="int4pack")
    module = Int4Linear(weight, kernel="int4pack")
    module.set_wide_kernel("dequant")
    x = torch.randn(MAX_NARROW_ROWS + 1, 64)  # [rows, in]
    # Up to MAX_NARROW_ROWS rows the decode kernel, past them the dense matmul on the float weight.
    assert torch.equal(module(x[:MAX_NARROW_ROWS]), narrow_only(x[:MAX_NARROW_ROWS]))
    assert torch.equal(module(x), F.linear(x, weight.dequantize()))
    assert module.kernel == "int4pack" and "wide kernel=dequant" in repr(module)
    # A wide kernel that cannot take these activations is not used: int4dot takes bf16 only.
    module.set_wide_kernel("int4dot")
    assert torch.equal(module(x), narrow_only(x))
    with pytest.raises(ValueError, match="wide kernel"):
        module.set_wide_kernel("fast")


def test_state_dict_round_trip_and_cache_invalidation() -> None:
    weight = Int4Weight.from_float(random_weight(32, 64), 32)
    module = Int4Linear(weight, torch.randn(32), kernel="dequant")
    assert set(module.state_dict()) == {"qweight", "scales", "zeros", "bias"}
    assert module.qweight.shape == (32, 32) and module.qweight.dtype == torch.uint8  # two codes per byte
    back = module.int4_weight()
    assert torch.equal(back.q, weight.q) and torch.equal(back.scales, weight.scales)
    x = torch.randn(4, 64)
    y = module(x)
    other = Int4Linear(Int4Weight.from_float(random_weight(32, 64, seed=9), 32), torch.zeros(32), kernel="dequant")
    other(x)  # builds its cached float weight from the old codes
    other.load_state_dict(module.state_dict())
    torch.testing.assert_close(other(x), y, rtol=0, atol=0)  # the stale cache was dropped
    module.to(torch.float64)  # casting drops the cache too: it is rebuilt for the new dtype
    assert module(x.double()).dtype == torch.float64


# ---- GGUF Q4 blocks ---------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1])
def test_decode_q4_blocks_matches_gguf(qtype: gguf.GGMLQuantizationType) -> None:
    w = np.random.default_rng(0).standard_normal((48, 128)).astype(np.float32)  # [out, in]
    blocks = quants.quantize(w, qtype)  # [out, bytes]
    weight = gguf_q4._decode_q4_blocks(blocks, 128, has_min=qtype == gguf.GGMLQuantizationType.Q4_1)
    want = torch.from_numpy(quants.dequantize(blocks, qtype))  # [out, in]
    assert weight.group_size == 32 and weight.q.shape == (48, 128)
    torch.testing.assert_close(weight.dequantize(), want, rtol=0, atol=0)


@pytest.mark.parametrize("n_head", [3, 9])
def test_rope_unpermute_rows_matches_transformers(n_head: int) -> None:
    rows = n_head * 64
    w = np.random.default_rng(1).standard_normal((rows, 8)).astype(np.float32)  # [out, in]
    want = LlamaTensorProcessor()._reverse_permute_weights(w, n_head, n_head)
    got = w[rope_unpermute_rows(rows, n_head).numpy()]
    np.testing.assert_array_equal(got, want)
    with pytest.raises(InvalidArgumentError):
        rope_unpermute_rows(rows + 1, n_head)


def test_gguf_blocks_equal_transformers_weights(smollm2: LoadedModel) -> None:
    """Every Q4_1 tensor read from its own blocks is the weight transformers dequantized on load."""
    model = smollm2.model
    weights = read_gguf_int4_weights(embedded_model_path(DEFAULT_MODEL), model.config)
    layers = model.config.num_hidden_layers
    expected = {f"model.layers.{i}.{part}.{p}.weight" for i in range(layers)
                for part, projs in (("self_attn", PROJECTIONS[:4]), ("mlp", PROJECTIONS[4:])) for p in projs}
    assert set(weights) == expected and len(weights) == 210  # token_embd (Q8_0) and norms (F32) left out
    params = dict(model.named_parameters())
    worst = 0.0
    for name, weight in weights.items():
        assert weight.group_size == 32 and weight.q.shape == params[name].shape, name
        worst = max(worst, float((weight.dequantize() - params[name]).abs().max()))
    assert worst <= 1e-6, worst  # same fp16 d and m, same fp32 sum: bit-exact in practice


def test_gguf_int4_weights_are_cached_after_the_first_read(
    smollm2: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = embedded_model_path(DEFAULT_MODEL)
    first = gguf_int4_weights(gguf, smollm2.model.config, cache_dir=tmp_path)
    assert len(list(tmp_path.rglob("int4-blocks-h9-kv3.safetensors"))) == 1

    def no_second_read(*args: object) -> None:
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr(gguf_q4, "read_gguf_int4_weights", no_second_read)
    again = gguf_int4_weights(gguf, smollm2.model.config, cache_dir=tmp_path)
    assert again.keys() == first.keys()
    for name, weight in first.items():
        for part in ("q", "scales", "zeros"):
            assert torch.equal(getattr(again[name], part), getattr(weight, part)), (name, part)
        assert again[name].group_size == weight.group_size


# ---- quantize_int4 ----------------------------------------------------------------------------


def test_quantize_int4_tiny_llama() -> None:
    model = tiny_llama()
    torch.manual_seed(5)
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        ref_logits = model(ids).logits  # [2, 24, vocab]
    embed_before = model.model.embed_tokens.weight.detach().clone()

    assert quantize_int4(model) is model

    for layer in model.model.layers:
        for name in PROJECTIONS:
            module = getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)
            assert isinstance(module, Int4Linear) and module.source == "float" and module.kernel in INT4_KERNELS
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model.model.embed_tokens.weight, embed_before, rtol=0, atol=0)
    assert isinstance(model.lm_head, Int4Linear)
    assert model.config.tie_word_embeddings is False
    assert model.config.specdec_quantization == "int4"

    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == ref_logits.shape and logits.dtype == torch.float32
    rel = ((logits - ref_logits).norm() / ref_logits.norm()).item()
    assert rel < 0.15, rel
    agreement = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    assert agreement >= 0.9, agreement
    model.tie_weights()  # untied for good
    assert isinstance(model.lm_head, Int4Linear)


def test_quantize_int4_takes_matching_gguf_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """GGUF weights are used where name, shape and group size match; a shape mismatch is refused."""
    model = tiny_llama()
    q_proj = model.model.layers[0].self_attn.q_proj.weight.detach()  # [64, 64]
    found = {
        "model.layers.0.self_attn.q_proj.weight": Int4Weight.from_float(q_proj + 0.01, 32),
        "model.layers.0.mlp.down_proj.weight": Int4Weight.from_float(torch.zeros(64, 128), 64),  # other group size
    }
    monkeypatch.setattr(qi4, "gguf_int4_weights", lambda path, config: found)
    quantize_int4(model, gguf_path="model.gguf")
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.source == "gguf" and layer.mlp.down_proj.source == "float"
    torch.testing.assert_close(layer.self_attn.q_proj.int4_weight().dequantize(),
                               found["model.layers.0.self_attn.q_proj.weight"].dequantize())
    assert sum(m.source == "gguf" for m in model.modules() if isinstance(m, Int4Linear)) == 1

    found["model.layers.0.self_attn.q_proj.weight"] = Int4Weight.from_float(torch.zeros(32, 64), 32)
    with pytest.raises(InvalidArgumentError):
        quantize_int4(tiny_llama(), gguf_path="model.gguf")


def test_quantize_int4_can_keep_lm_head() -> None:
    model = tiny_llama()
    quantize_int4(model, include_lm_head=False)
    assert isinstance(model.lm_head, nn.Linear)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.tie_word_embeddings is True


def test_quantize_int4_from_gguf_agrees_with_target(smollm2: LoadedModel) -> None:
    """Linear layers from the GGUF's own Q4_1 blocks are the target's weights: greedy agreement ~1.

    Teacher-forced: one forward of each model over the same text, argmax compared at every position.
    The lm_head stays fp32 here. The GGUF stores it (the tied embedding) as Q8_0, which is not one of
    its Q4 tensors: an int4 head would be a fresh, lossier quantization (agreement about 0.9).
    """
    target = smollm2.model
    draft = quantize_int4(copy.deepcopy(target), gguf_path=embedded_model_path(DEFAULT_MODEL), include_lm_head=False)
    sources = [m.source for m in draft.modules() if isinstance(m, Int4Linear)]
    assert sources == ["gguf"] * 210 and isinstance(draft.lm_head, nn.Linear)
    ids = smollm2.tokenizer(" ".join(PROMPTS), return_tensors="pt").input_ids  # [1, tokens]
    assert ids.shape[1] >= 40
    with torch.inference_mode():
        want = target(ids).logits[0].argmax(-1)  # [tokens]
        got = draft(ids).logits[0].argmax(-1)
    alpha = (got == want).float().mean().item()
    assert alpha >= 0.95, alpha
