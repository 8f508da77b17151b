"""Tests for the ``int4dot`` kernel (`specdec.model.int4_dot`): its packed layout, its results
against the dequantized weight and torch's packed kernel, inside a compiled graph, and the
fallback where it cannot be built. The build for this CPU's best instruction set is the one tested."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from specdec.model import int4_dot
from specdec.model import quantize_int4 as qi4
from specdec.model.int4_weight import Int4Weight
from specdec.model.quantize_int4 import Int4Linear

needs_kernel = pytest.mark.skipif(not int4_dot.available(),
                                  reason="int4dot needs AVX-512 BF16 or AVX2, and a C++ compiler")


def weight(out: int, in_features: int, group_size: int, *, seed: int = 0) -> Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    return Int4Weight.from_float(torch.randn(out, in_features, generator=gen) * 0.05 + 0.02, group_size)


def test_pack_layout() -> None:
    """Byte 2i of a 32-byte piece holds output i's codes for k and k + 2; byte 2i + 1 for k + 1 and k + 3."""
    w = weight(128, 64, 32)
    codes, sz = int4_dot.pack(w)
    assert codes.shape == (2, 16, 128) and codes.dtype == torch.uint8  # [out / 64, in / 4, 128]
    assert sz.shape == (2, 2, 2, 64) and sz.dtype == torch.bfloat16  # [out / 64, groups, 2, 64]
    block, chunk, piece, i = 1, 5, 2, 7  # output 64 + 16 * 2 + 7, inputs 20..23
    o, k = 64 + 16 * piece + i, 4 * chunk
    byte_even, byte_odd = codes[block, chunk, 32 * piece + 2 * i], codes[block, chunk, 32 * piece + 2 * i + 1]
    assert (int(byte_even) & 15, int(byte_even) >> 4) == (int(w.q[o, k]), int(w.q[o, k + 2]))
    assert (int(byte_odd) & 15, int(byte_odd) >> 4) == (int(w.q[o, k + 1]), int(w.q[o, k + 3]))
    assert sz[block, 0, 0, 16 * piece + i] == w.scales[o, 0].to(torch.bfloat16)
    assert sz[block, 0, 1, 16 * piece + i] == (w.zeros[o, 0] + 8 * w.scales[o, 0]).to(torch.bfloat16)
    with pytest.raises(ValueError):
        int4_dot.pack(weight(96, 64, 32))  # out must be a multiple of 64


@needs_kernel
@pytest.mark.parametrize(("out", "in_features", "group_size"),
                         [(64, 128, 32), (192, 576, 32), (128, 1536, 64), (64, 256, 128)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_matches_the_dequantized_weight_and_int4pack(out: int, in_features: int, group_size: int, rows: int) -> None:
    w = weight(out, in_features, group_size)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1)).bfloat16()  # [rows, in]
    got = int4_dot.int4_dot_mm(x, *int4_dot.pack(w), group_size).float()  # [rows, out]
    # The kernel's inputs are bf16 (x, scales, offsets) and its output is rounded to bf16.
    scales = w.scales.bfloat16().float()
    zeros = (w.zeros + 8 * w.scales).bfloat16().float() - 8 * scales
    want = x.double() @ Int4Weight(w.q, scales, zeros, group_size).dequantize().double().t()  # [rows, out]
    torch.testing.assert_close(got.double(), want, rtol=8e-3, atol=8e-3 * float(want.abs().max()))
    if qi4.int4pack_supported(w):
        packed, scales_and_zeros = qi4.int4pack_operands(w, torch.bfloat16)
        ref = torch._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros).float()  # [rows, out]
        # Same sum, other rounding order: at most one bf16 step apart.
        assert float((got - ref).abs().max()) <= 2 ** -7 * float(ref.abs().max())


@needs_kernel
def test_int4_linear_and_compiled_graph() -> None:
    module = Int4Linear(weight(128, 256, 32), torch.randn(128).bfloat16(), kernel="int4dot")
    x = torch.randn(2, 3, 256).bfloat16()  # [2, 3, in]
    eager = module(x)
    assert module.kernel == "int4dot" and eager.shape == (2, 3, 128)
    compiled = torch.compile(module, fullgraph=True)  # the fake implementation gives the output's shape
    torch.testing.assert_close(compiled(x), eager, rtol=0, atol=0)
    with pytest.raises(ValueError):
        Int4Linear(weight(128, 256, 32), kernel="int4dot").prepare("cpu", torch.float32)  # bf16 activations only


def test_instruction_set_is_the_best_the_cpu_has() -> None:
    avx2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
    assert int4_dot.instruction_set(avx512) == "avx512_bf16"
    assert int4_dot.instruction_set(avx2) == "avx2"
    assert int4_dot.instruction_set(avx2 - {"fma"}) is None
    assert int4_dot.instruction_set(frozenset()) is None


def test_not_available_without_the_instructions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int4_dot, "instruction_set", lambda: None)
    assert int4_dot.available.__wrapped__() is False
    module = Int4Linear(weight(128, 64, 32), prefer="int4dot")
    monkeypatch.setattr(int4_dot, "available", lambda: False)
    assert module.prepare("cpu", torch.bfloat16) in ("int4pack", "dequant")  # the next kernel that runs


def test_a_failed_build_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    if int4_dot.instruction_set() is None:
        pytest.skip("the build is only tried on CPUs with AVX-512 BF16 or AVX2")
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(int4_dot, "SOURCES", (broken,))
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger=int4_dot.__name__):
        assert int4_dot.available.__wrapped__() is False
    assert "not available" in caplog.text
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-built is left to load
