"""Projection layers of our forward: fused where Llama allows it, on the kernel this machine runs fastest.

- **Fusion.** q, k and v read the same input, as do gate and up: concatenating their
  weights along the output dimension turns seven matmuls per layer into four, which
  matters when a 1-token step is dominated by per-call overhead. `fuse` concatenates
  dense, int8 and int4 weights alike (each quantized format keeps its per-row or
  per-group scales, which concatenate along the same axis).
- **Kernel choice for dense weights.** On CPU, `F.linear` goes to the BLAS library, whose
  skinny-matrix path is several times slower than oneDNN's with a pre-packed weight on some
  CPUs and the faster one on others. So each `DenseLinear` runs the kernel measured faster
  for its shape (`specdec.tuning.kernels.measure_dense`), separately for narrow inputs (up to
  `MAX_NARROW_ROWS` rows: a decode step, a single request's verify) and wide ones (a batch's
  verify): one choice for both made a forward just past the narrow limit cost twice one
  within it (docs/performance.md#dense-kernels). The packed copy costs a second copy of the
  weights. On CUDA (or without oneDNN) it is `F.linear`.
- **Prompts keep `F.linear` when wide.** oneDNN sums in another order than the BLAS
  library that `transformers` runs on, and a prompt's logits then differ from transformers'
  by more than the parity tests allow. So wide inputs take the chosen kernel only inside
  `fastest_wide_kernel()`, which verify and decode steps enter; a prompt's prefill does not.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from specdec.model.quantize import Int8Linear

log = logging.getLogger(__name__)

#: Inputs up to this many rows are narrow.
MAX_NARROW_ROWS = 16


def onednn_available(weight: torch.Tensor) -> bool:
    """Whether oneDNN's linear can take this weight (CPU, fp32 or bf16, a build with oneDNN)."""
    return (
        weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and weight.dtype in (torch.float32, torch.bfloat16)
    )


def onednn_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight packed for oneDNN's linear, or None where it cannot run here (e.g. bf16 on a
    CPU without the instructions)."""
    if not onednn_available(weight):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    except RuntimeError as error:
        log.debug("no oneDNN linear for %s here: %s", weight.dtype, error)
        return None


def onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


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
    """`y = x @ weight.T` on one of `KERNELS` for narrow and for wide inputs (see the module
    docstring): `kernel` for both, `F.linear` ("aten") by default, until `set_kernels`. Wide
    inputs outside `fastest_wide_kernel()` take `F.linear`."""

    def __init__(self, weight: torch.Tensor, *, kernel: str = "aten") -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight  # [out, in]; the aten path uses it
        self._packed: torch.Tensor | None = None
        self.set_kernels(kernel, kernel)

    def set_kernels(self, narrow: str, wide: str) -> None:
        """Run inputs of up to `MAX_NARROW_ROWS` rows on `narrow`, wider ones on `wide`; "onednn"
        falls back to "aten" where oneDNN cannot take the weight."""
        for kernel in (narrow, wide):
            if kernel not in KERNELS:
                raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        if "onednn" in (narrow, wide) and self._packed is None:
            self._packed = onednn_packed(self.weight)
        if self._packed is None:
            narrow = wide = "aten"
        #: The kernel for inputs of up to MAX_NARROW_ROWS rows, and for wider ones.
        self.narrow_kernel, self.wide_kernel = narrow, wide
        if "onednn" not in (narrow, wide):
            self._packed = None

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
                return onednn_linear(x, self._packed)
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
