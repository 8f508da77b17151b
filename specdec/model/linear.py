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
  `DenseLinear` times both on the layer's own shape, once per shape, and keeps the faster
  for each of two kinds of input: narrow ones (up to 16 rows: a decode step, a single
  request's verify; timed at 1 and 5 rows) and wide ones (a batch's verify; timed at 64
  rows). One choice for both was not enough: with oneDNN for narrow inputs only, a
  forward over 17 rows cost twice one over 16 (SmolLM2-135M fp32 target, 97 against
  57 ms, AMD EPYC Zen 4), and the K planner avoided every verify past 16 rows of a batch.
  The packed copy costs a second copy of the weights in memory. On CUDA (or without
  oneDNN) it is `F.linear`.
- **Prompts keep `F.linear` when wide.** oneDNN sums in another order than the BLAS
  library that `transformers` runs on: a prompt's logits then differ from transformers'
  by up to 1.3e-4 (the parity test's batched prefill; 5.7e-5 with `F.linear`), past the
  1e-4 the parity tests hold our forward to. So wide inputs take the measured choice
  only inside `fastest_wide_kernel()`, which verify and decode steps enter (their narrow
  inputs already took the measured choice); a prompt's prefill does not.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from specdec.model.quantize import Int8Linear

log = logging.getLogger(__name__)

#: Rows the kernel benchmark times for narrow inputs (a decode step, a verify chunk) ...
_NARROW_BENCH_ROWS = (1, 5)
#: ... and for wide ones (a batch's verify).
_WIDE_BENCH_ROWS = (64,)
#: Inputs up to this many rows are narrow.
MAX_NARROW_ROWS = 16


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


#: (out, in, dtype) -> whether oneDNN won for (narrow, wide) inputs: timed once per shape and process.
_onednn_choices: dict[tuple[int, int, torch.dtype], tuple[bool, bool]] = {}


def _prefer_onednn(weight: torch.Tensor) -> tuple[bool, bool]:
    """Whether oneDNN with a packed weight beats `F.linear` for this weight's shape here, for
    narrow and for wide inputs (see the module docstring).

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
        _onednn_choices[key] = (False, False)
        return _onednn_choices[key]

    def onednn_wins(bench_rows: Sequence[int]) -> bool:
        aten = onednn = 0.0
        for rows in bench_rows:
            x = torch.randn(rows, in_features, dtype=weight.dtype)  # [rows, in]
            aten += _time(functools.partial(F.linear, x, weight))
            onednn += _time(functools.partial(torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], ""))
        log.debug("linear %dx%d %s at %s rows: aten %.0f us, onednn %.0f us",
                  out_features, in_features, weight.dtype, bench_rows, aten * 1e6, onednn * 1e6)
        return onednn < aten

    _onednn_choices[key] = (onednn_wins(_NARROW_BENCH_ROWS), onednn_wins(_WIDE_BENCH_ROWS))
    return _onednn_choices[key]


KERNELS = ("aten", "onednn")
_wide_on_choice = contextvars.ContextVar("wide_on_choice", default=False)


@contextmanager
def fastest_wide_kernel(enabled: bool = True) -> Iterator[None]:
    """Within the block, wide inputs take the kernel measured fastest instead of `F.linear`
    (see the module docstring)."""
    token = _wide_on_choice.set(enabled)
    try:
        yield
    finally:
        _wide_on_choice.reset(token)


class DenseLinear(nn.Module):
    """`y = x @ weight.T` on the faster of `F.linear` and oneDNN for narrow and for wide
    inputs (see the module docstring); `kernel` forces one for both. Wide inputs outside
    `fastest_wide_kernel()` take `F.linear`."""

    def __init__(self, weight: torch.Tensor, *, kernel: str | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if kernel is not None and kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        if kernel is not None:
            narrow = wide = kernel == "onednn"
        else:
            narrow, wide = _prefer_onednn(weight) if _onednn_available(weight) else (False, False)
        #: The kernel for inputs of up to MAX_NARROW_ROWS rows, and for wider ones.
        self.narrow_kernel, self.wide_kernel = KERNELS[narrow], KERNELS[wide]
        self.weight = weight  # [out, in]; the aten path uses it
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, None) if narrow or wide else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] -> [..., out]."""
        # Under torch.compile the packed oneDNN weight is opaque to tracing; the compiler
        # picks its own kernel for the plain weight.
        if self._packed is not None and not torch.compiler.is_compiling():
            if x.numel() <= MAX_NARROW_ROWS * self.in_features:
                kernel = self.narrow_kernel
            else:
                kernel = self.wide_kernel if _wide_on_choice.get() else "aten"
            if kernel == "onednn":
                return torch.ops.mkldnn._linear_pointwise(x, self._packed, None, "none", [], "")
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"kernels: narrow {self.narrow_kernel}, wide {self.wide_kernel}")


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
