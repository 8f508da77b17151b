"""Projection layers of our forward: fused where Llama allows it, on the kernel this machine runs fastest.

Two levers, both measured rather than assumed:

- **Fusion.** q, k and v read the same input, as do gate and up: concatenating their
  weights along the output dimension turns seven matmuls per layer into four, which
  matters when a 1-token step is dominated by per-call overhead. `fuse` concatenates
  dense, int8 and int4 weights alike (each quantized format keeps its per-row or
  per-group scales, which concatenate along the same axis).
- **Kernel choice for dense weights.** On CPU, `F.linear` goes to the BLAS library; on
  some CPUs (seen on an AMD EPYC with torch's MKL build) its skinny-matrix path is 2-4×
  slower than oneDNN's with a pre-packed weight, on others it is the faster one. So
  `DenseLinear` times both on the layer's own shape at 1 and at a few rows, once per
  shape, and keeps the faster for decode and verify inputs (prefills stay on
  `F.linear`). The packed copy costs a second copy of the weights in memory. On CUDA
  (or without oneDNN) it is `F.linear`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdec.model.quantize import Int8Linear

log = logging.getLogger(__name__)

#: Rows the kernel benchmark times: a decode step and a typical verify chunk.
_BENCH_ROWS = (1, 5)
#: Inputs with more rows (prompt prefills) always take `F.linear`: the choice was timed
#: on few rows only, and prefill logits then match `transformers` as closely as before.
MAX_ONEDNN_ROWS = 16


def _onednn_available(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and weight.dtype in (torch.float32, torch.bfloat16)
    )


def _time(fn: Callable[[], object], max_repeats: int = 8, budget_s: float = 0.02) -> float:
    """Mean seconds per call after a warm-up; big layers (an output head) get fewer repeats."""
    started = time.perf_counter()
    fn()  # warm-up: first-call packing and allocation
    repeats = max(1, min(max_repeats, int(budget_s / max(time.perf_counter() - started, 1e-9))))
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


#: (out, in, dtype) -> whether oneDNN won: timed once per shape and process.
_onednn_choices: dict[tuple[int, int, torch.dtype], bool] = {}


def _prefer_onednn(weight: torch.Tensor) -> bool:
    """Whether oneDNN with a packed weight beats `F.linear` for this weight's shape here.

    Timed on the weight itself (values do not change the speed): a random stand-in of an
    output head's size (128k x 3k for Llama 3.2) took seconds just to generate.
    """
    out_features, in_features = weight.shape
    key = (out_features, in_features, weight.dtype)
    if key in _onednn_choices:
        return _onednn_choices[key]
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    except RuntimeError as error:  # e.g. bf16 on a CPU without avx512bw / avx_ne_convert
        log.debug("no oneDNN linear for %s here: %s", weight.dtype, error)
        _onednn_choices[key] = False
        return False
    aten = onednn = 0.0
    for rows in _BENCH_ROWS:
        x = torch.randn(rows, in_features, dtype=weight.dtype)  # [rows, in]
        aten += _time(functools.partial(F.linear, x, weight))
        onednn += _time(functools.partial(torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], ""))
    log.debug("linear %dx%d %s: aten %.0f us, onednn %.0f us", out_features, in_features, weight.dtype, aten * 1e6, onednn * 1e6)
    _onednn_choices[key] = onednn < aten
    return _onednn_choices[key]


class DenseLinear(nn.Module):
    """`y = x @ weight.T` on the faster of `F.linear` and oneDNN (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, *, kernel: str | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if kernel is None:
            fast = _onednn_available(weight) and _prefer_onednn(weight)
            kernel = "onednn" if fast else "aten"
        if kernel not in ("aten", "onednn"):
            raise ValueError(f"kernel must be 'aten' or 'onednn', got {kernel!r}")
        self.kernel = kernel
        self.weight = weight  # [out, in]; the aten path (and prefills) use it
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, None) if kernel == "onednn" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] -> [..., out]."""
        # Under torch.compile the packed oneDNN weight is opaque to tracing; the compiler
        # picks its own kernel for the plain weight.
        if self._packed is not None and x.numel() <= MAX_ONEDNN_ROWS * self.in_features and not torch.compiler.is_compiling():
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, None, "none", [], "")
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


def fuse(modules: Sequence[nn.Module]) -> nn.Module:
    """One projection computing every module's output, concatenated along the last dimension.

    Works for `nn.Linear` (no bias, as in Llama), `Int8Linear` and any quantized linear
    with a `concat` classmethod (the int4 layer). A single module is wrapped or returned
    as is.
    """
    first = modules[0]
    if isinstance(first, nn.Linear):
        if any(m.bias is not None for m in modules):
            raise ValueError("fusing projections with a bias is not supported")
        linears: list[nn.Linear] = list(modules)  # type: ignore[arg-type]
        if len(linears) == 1:
            return DenseLinear(first.weight.detach())
        weight = torch.cat([m.weight.detach() for m in linears], dim=0)  # [sum(out), in]
        offset = 0
        for m in linears:  # the originals become views of the fused weight: no second copy
            rows = m.weight.shape[0]
            m.weight = nn.Parameter(weight[offset : offset + rows], requires_grad=False)
            offset += rows
        return DenseLinear(weight)
    if isinstance(first, Int8Linear):
        parts: list[Int8Linear] = list(modules)  # type: ignore[arg-type]
        bias = None if parts[0].bias is None else torch.cat([m.bias for m in parts])  # type: ignore[misc]
        return Int8Linear(torch.cat([m.weight_int8 for m in parts]), torch.cat([m.scales for m in parts]), bias)
    concat = getattr(type(first), "concat", None)
    if callable(concat):
        return concat(list(modules))
    if len(modules) == 1:
        return first
    raise TypeError(f"cannot fuse projections of type {type(first).__name__}")
