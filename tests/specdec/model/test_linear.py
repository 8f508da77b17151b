"""Dense projections: which kernel runs for narrow and wide inputs, prompts and verify steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.model.linear import MAX_NARROW_ROWS, DenseLinear, fastest_wide_kernel, onednn_available

IN = 576  # the kernels sum a row of this length in different orders, so their results differ in the last bits
WEIGHT = torch.randn(96, IN, generator=torch.Generator().manual_seed(0))  # [out, in]
pytestmark = pytest.mark.skipif(not onednn_available(WEIGHT), reason="no oneDNN linear on this build")


def _onednn(x: torch.Tensor) -> torch.Tensor:
    packed = torch.ops.mkldnn._reorder_linear_weight(WEIGHT, None)
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _inputs(batch: int) -> torch.Tensor:
    x = torch.randn(batch, MAX_NARROW_ROWS, IN, generator=torch.Generator().manual_seed(batch))  # [B, T, in]
    if torch.equal(F.linear(x, WEIGHT), _onednn(x)):
        pytest.skip("both kernels round alike on this CPU: the test cannot tell which one ran")
    return x


def test_wide_inputs_take_the_chosen_kernel_only_inside_fastest_wide_kernel() -> None:
    layer = DenseLinear(WEIGHT, kernel="onednn")
    wide = _inputs(2)  # 32 rows
    assert torch.equal(layer(wide), F.linear(wide, WEIGHT))  # a prompt: the BLAS library's rounding
    with fastest_wide_kernel():
        assert torch.equal(layer(wide), _onednn(wide))
    assert torch.equal(layer(wide), F.linear(wide, WEIGHT))  # the block restored the default


def test_narrow_inputs_take_the_chosen_kernel_everywhere() -> None:
    layer = DenseLinear(WEIGHT, kernel="onednn")
    narrow = _inputs(1)
    assert torch.equal(layer(narrow), _onednn(narrow))
    aten = DenseLinear(WEIGHT, kernel="aten")
    with fastest_wide_kernel():
        wide = _inputs(3)
        assert torch.equal(aten(wide), F.linear(wide, WEIGHT))


def test_kernels_are_set_per_kind_of_input() -> None:
    layer = DenseLinear(WEIGHT)
    assert (layer.narrow_kernel, layer.wide_kernel) == ("aten", "aten")  # untuned: F.linear
    layer.set_kernels("onednn", "aten")
    narrow, wide = _inputs(1), _inputs(3)
    with fastest_wide_kernel():
        assert torch.equal(layer(narrow), _onednn(narrow)) and torch.equal(layer(wide), F.linear(wide, WEIGHT))
    with pytest.raises(ValueError, match="kernel"):
        DenseLinear(WEIGHT, kernel="mkl")
