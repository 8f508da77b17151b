"""4-bit group-wise weight-only quantization for the draft model.

Each weight is stored as ``w[o, i] ≈ scale[o, g] * q[o, i] + zero[o, g]``, where ``g = i // group_size``
and ``q`` is an unsigned 4-bit code in 0..15. This is the form of llama.cpp's Q4_1 blocks, and Q4_0 is
the special case ``zero = -8 * scale``. So a GGUF checkpoint's own blocks load without re-quantizing
(`specdec.model.gguf_q4`). The embedded target was itself dequantized from those blocks, so a draft built
from them computes with the target's own weights, up to float rounding.

There are three matmul kernels; which is fastest depends on the CPU (docs/performance.md#int4-kernels),
so the service times them at start-up (`specdec.tuning.kernels`) and passes the winner as ``prefer``:

- ``"int4dot"``: our own kernel for CPUs with AVX-512 BF16 or AVX2 and bfloat16 activations
  (`specdec.model.int4_dot`), compiled on first use. It needs ``out % 64 == 0``.
- ``"int4pack"``: `torch._weight_int4pack_mm_for_cpu` (CPU only). It takes the weight packed by
  `torch._convert_weight_to_int4pack_for_cpu(q_int32 [out, in], 1)` and ``scales_and_zeros`` of shape
  [in // group_size, out, 2] in the activation dtype. It computes ``w = (q - 8) * sz[..., 0] + sz[..., 1]``
  (checked by experiment with torch 2.13), so we pass ``sz[..., 0] = scale`` and
  ``sz[..., 1] = zero + 8 * scale``. It accepts float32, bfloat16 and float16 activations. It needs
  ``out % 16 == 0``, a group size in {32, 64, 128, 256} and ``in % group_size == 0``. Without
  AVX-512 only its bfloat16 path is vectorised; float32 and float16 take a scalar loop.
- ``"dequant"``: ``F.linear(x, w)``, with ``w`` dequantized once into the activation dtype and cached
  in the module. It works on any device, CUDA included. The cache costs as much memory as the float
  weight. We accept that: the draft is small, and dequantizing on every call would cost more time
  than the matmul itself.

The 4-bit kernels are built for decode-shaped calls and cost about a row's work per row; a wide
call (a draft catching up on a prompt) runs faster as a dense matmul on the CPU's bf16 units. So
a layer may also take a second kernel for inputs of more than `MAX_NARROW_ROWS` rows
(`Int4Linear.set_wide_kernel`, chosen at start-up by `specdec.tuning.kernels.measure_int4_wide`);
with ``"dequant"`` there it keeps the float weight beside the codes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.errors import InvalidArgumentError
from specdec.model import int4_dot
from specdec.model.choices import INT4_KERNELS
from specdec.model.gguf_q4 import gguf_int4_weights
from specdec.model.int4_weight import Int4Weight
from specdec.model.linear import MAX_NARROW_ROWS
from specdec.model.quantize import mark_quantized

log = logging.getLogger(__name__)

INT4PACK_GROUP_SIZES = frozenset({32, 64, 128, 256})
#: `_weight_int4pack_mm_for_cpu` computes ``(q - 8) * scale + offset``; our codes are unsigned.
INT4PACK_Q_OFFSET = 8


# ---- kernels ----------------------------------------------------------------------------------


def int4pack_supported(weight: Int4Weight) -> bool:
    """Whether this layer's shape fits `_weight_int4pack_mm_for_cpu`."""
    return (
        hasattr(torch, "_weight_int4pack_mm_for_cpu")
        and weight.group_size in INT4PACK_GROUP_SIZES
        and weight.out_features % 16 == 0
    )


def int4pack_operands(weight: Int4Weight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed weight and ``scales_and_zeros`` [groups, out, 2] for `_weight_int4pack_mm_for_cpu`.

    The kernel computes ``(q - 8) * s + z``, and ours is ``scale * q + zero``. So ``s = scale`` and
    ``z = zero + 8 * scale``. We add the offset in fp32 and round once, to the activation dtype.
    """
    packed = torch._convert_weight_to_int4pack_for_cpu(weight.q.cpu().to(torch.int32), 1)  # [out, in // 2]
    offsets = weight.zeros + INT4PACK_Q_OFFSET * weight.scales  # [out, groups]
    scales_and_zeros = torch.stack([weight.scales.t(), offsets.t()], dim=-1)  # [groups, out, 2]
    return packed, scales_and_zeros.to(dtype).contiguous()


def default_int4_kernel(device_type: str, dtype: torch.dtype) -> str:
    """The kernel to prefer when nothing was measured: ours where it runs (bfloat16 on a CPU
    with AVX-512 BF16), else torch's packed kernel on CPU, else ``"dequant"``."""
    if device_type != "cpu":
        return "dequant"
    if dtype == torch.bfloat16 and int4_dot.available():
        return "int4dot"
    return "int4pack" if hasattr(torch, "_weight_int4pack_mm_for_cpu") else "dequant"


def kernel_supported(kernel: str, weight: Int4Weight, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``kernel`` can compute this layer for activations of ``dtype`` on ``device``."""
    if kernel == "dequant":
        return True
    if device.type != "cpu":
        return False
    if kernel == "int4dot":
        return dtype == torch.bfloat16 and int4_dot.supported(weight) and int4_dot.available()
    return int4pack_supported(weight)


def kernel_operands(
    kernel: str, weight: Int4Weight, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """What ``kernel`` multiplies with: packed codes and scales, or the dequantized weight."""
    if kernel == "int4dot":
        return int4_dot.pack(weight)
    if kernel == "int4pack":
        return int4pack_operands(weight, dtype)
    return (weight.dequantize().to(device=device, dtype=dtype),)  # [out, in]


def kernel_matmul(kernel: str, x: torch.Tensor, operands: tuple[torch.Tensor, ...], group_size: int) -> torch.Tensor:
    """``x`` [rows, in] times the weight ``kernel_operands`` built for ``kernel``: [rows, out]."""
    if kernel == "int4dot":
        return int4_dot.int4_dot_mm(x.contiguous(), operands[0], operands[1], group_size)
    if kernel == "int4pack":
        return torch._weight_int4pack_mm_for_cpu(x.contiguous(), operands[0], group_size, operands[1])
    return F.linear(x, operands[0])


# ---- module -----------------------------------------------------------------------------------


class Int4Linear(nn.Module):
    """A drop-in replacement for `nn.Linear` that holds an `Int4Weight`.

    The state dict holds ``qweight`` (two codes per byte: even input column in the low nibble),
    ``scales``, ``zeros`` and ``bias``. This format does not depend on the device or the torch
    version. Whatever a kernel needs (the packed codes for ``"int4dot"`` and ``"int4pack"``, the
    float weight for ``"dequant"``) is derived from it on first use for each (device, dtype) and is
    not saved. Memory per weight: 0.5 byte of codes, plus 0.5 byte packed for ``"int4dot"`` or
    ``"int4pack"``, or the full float weight for ``"dequant"``.
    ``module.to(dtype)`` also casts ``scales`` and ``zeros``. Quantize the model after it has its
    final dtype, so the scales stay in fp32.

    ``kernel`` is ``"auto"`` (``prefer``, or `default_int4_kernel` when that is empty, falling back
    to the next of `INT4_KERNELS` for shapes it cannot take) or one of `INT4_KERNELS`. After `prepare` or the
    first forward, the attribute ``kernel`` names the kernel in use. Inputs of more than
    `MAX_NARROW_ROWS` rows take ``wide_kernel`` where `set_wide_kernel` set one.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self, weight: Int4Weight, bias: torch.Tensor | None = None, *, kernel: str = "auto", prefer: str = "",
        source: str = "",
    ) -> None:
        super().__init__()
        if kernel not in ("auto", *INT4_KERNELS):
            raise ValueError(f"kernel must be 'auto' or one of {INT4_KERNELS}, got {kernel!r}")
        if prefer not in ("", *INT4_KERNELS):
            raise ValueError(f"prefer must be empty or one of {INT4_KERNELS}, got {prefer!r}")
        if kernel == "int4pack" and not int4pack_supported(weight):
            raise ValueError(f"int4pack cannot take out={weight.out_features}, group_size={weight.group_size}")
        if weight.in_features % 2:
            raise ValueError(f"in_features must be even, got {weight.in_features}")
        if bias is not None and tuple(bias.shape) != (weight.out_features,):
            raise ValueError(f"bias must have shape [{weight.out_features}], got {list(bias.shape)}")
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.group_size = weight.group_size
        self.requested_kernel, self.prefer = kernel, prefer
        self.kernel = kernel if kernel != "auto" else ""
        self.source = source  # where the weights came from: "gguf", "float" (from_float) or ""
        self.register_buffer("qweight", weight.q[:, 0::2] | (weight.q[:, 1::2] << 4))  # [out, in // 2] uint8
        self.register_buffer("scales", weight.scales)  # [out, groups]
        self.register_buffer("zeros", weight.zeros)  # [out, groups]
        self.register_buffer("bias", bias)  # [out] or None
        self._cache_key: tuple[torch.device, torch.dtype] | None = None
        self._operands: tuple[torch.Tensor, ...] = ()
        #: The kernel for inputs of more than MAX_NARROW_ROWS rows ("": ``kernel``'s).
        self.wide_kernel = ""
        self._wide_operands: tuple[torch.Tensor, ...] = ()

    def int4_weight(self) -> Int4Weight:
        """The weight as an `Int4Weight` (codes unpacked), e.g. to concatenate layers."""
        q = torch.stack([self.qweight & 0x0F, self.qweight >> 4], dim=-1).reshape(self.out_features, self.in_features)
        return Int4Weight(q, self.scales.float(), self.zeros.float(), self.group_size)

    @classmethod
    def concat(cls, modules: list[Int4Linear]) -> Int4Linear:
        """One module computing every module's output, concatenated along the last dimension
        (q/k/v or gate/up fused into one matmul). Its kernel is chosen again for the fused shape."""
        if not modules:
            raise ValueError("concat needs at least one module")
        biases = [m.bias for m in modules]
        if any(b is None for b in biases) and any(b is not None for b in biases):
            raise ValueError("cannot concat modules with and without bias")
        bias = torch.cat([b for b in biases if b is not None]) if biases[0] is not None else None
        sources = {m.source for m in modules}
        requested = {m.requested_kernel for m in modules}
        return cls(
            Int4Weight.concat([m.int4_weight() for m in modules]),
            bias,
            kernel=requested.pop() if len(requested) == 1 else "auto",
            prefer=modules[0].prefer,
            source=sources.pop() if len(sources) == 1 else "mixed",
        )

    def prepare(self, device: torch.device | str, dtype: torch.dtype) -> str:
        """Choose the kernel for activations of ``dtype`` on ``device`` and build its operands; returns it.

        "auto" takes ``prefer`` (or `default_int4_kernel`), and the next one that fits where this
        layer's shape does not fit it (int4dot, then int4pack, then dequant).
        """
        device = torch.device(device)
        if self._cache_key == (device, dtype):
            return self.kernel
        weight = self.int4_weight()
        kernel = self.requested_kernel
        if kernel == "auto":
            best = INT4_KERNELS.index(self.prefer or default_int4_kernel(device.type, dtype))
            kernel = next(k for k in INT4_KERNELS[best:] if kernel_supported(k, weight, device, dtype))
        elif not kernel_supported(kernel, weight, device, dtype):
            raise ValueError(f"the {kernel} kernel cannot take this layer on {device} with {dtype} activations")
        self._operands = kernel_operands(kernel, weight, dtype, device)
        self.kernel, self._cache_key = kernel, (device, dtype)
        self._wide_operands = self._build_wide(weight, device, dtype)
        return kernel

    def int4dot_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed codes and scales the int4dot kernel multiplies with (`int4_dot.pack`), for
        native code that calls the kernel itself; the layer must be prepared for it."""
        if self.kernel != "int4dot" or len(self._operands) != 2:
            raise ValueError(f"this layer runs the {self.kernel or 'unprepared'} kernel, not int4dot")
        return self._operands[0], self._operands[1]

    def set_wide_kernel(self, kernel: str) -> None:
        """Run inputs of more than `MAX_NARROW_ROWS` rows on `kernel` ("": the narrow one's);
        a prepared layer builds only the wide kernel's operands."""
        if kernel not in ("", *INT4_KERNELS):
            raise ValueError(f"wide kernel must be empty or one of {INT4_KERNELS}, got {kernel!r}")
        self.wide_kernel, self._wide_operands = kernel, ()
        if self._cache_key is not None:
            self._wide_operands = self._build_wide(self.int4_weight(), *self._cache_key)

    def _build_wide(self, weight: Int4Weight, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The wide kernel's operands, or none where it is the narrow one or cannot take this layer."""
        wide = self.wide_kernel
        if wide and wide != self.kernel and kernel_supported(wide, weight, device, dtype):
            return kernel_operands(wide, weight, dtype, device)
        return ()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Int4Linear:
        self._cache_key, self._operands, self._wide_operands = None, (), ()  # moved or cast: derived operands are stale
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._cache_key, self._operands, self._wide_operands = None, (), ()
        super()._load_from_state_dict(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] -> [..., out], in the dtype of ``x``."""
        kernel, operands = self.prepare(x.device, x.dtype), self._operands
        x_2d = x.reshape(-1, self.in_features)  # [tokens, in]
        if self._wide_operands and x_2d.shape[0] > MAX_NARROW_ROWS:
            kernel, operands = self.wide_kernel, self._wide_operands
        y = kernel_matmul(kernel, x_2d, operands, self.group_size)  # [tokens, out]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)  # [..., out]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
            f"bias={self.bias is not None}, kernel={self.kernel or self.requested_kernel}, "
            f"wide kernel={self.wide_kernel or 'same'}, source={self.source or '?'}"
        )


# ---- whole model ------------------------------------------------------------------------------


def _int4_linear(
    linear: nn.Linear, name: str, weight: Int4Weight | None, gguf_path: Path | str | None, group_size: int,
    kernel: str, prefer: str, dtype: torch.dtype | None,
) -> tuple[Int4Linear, str]:
    """`linear` as an `Int4Linear` from the GGUF's own blocks (`weight`, when they have this
    group size) or quantized from its floats, prepared for `dtype` activations (default: the
    weight's); returns it and the kernel it chose."""
    w = linear.weight.detach()  # [out, in]
    if weight is not None and tuple(weight.q.shape) != tuple(w.shape):
        raise InvalidArgumentError(
            f"{gguf_path}: {name} is {list(weight.q.shape)} in the GGUF, {list(w.shape)} in the model"
        )
    source = "gguf"
    if weight is None or weight.group_size != group_size:
        weight, source = Int4Weight.from_float(w, group_size), "float"
    weight = Int4Weight(weight.q.to(w.device), weight.scales.to(w.device), weight.zeros.to(w.device), weight.group_size)
    bias = None if linear.bias is None else linear.bias.detach().clone()
    module = Int4Linear(weight, bias, source=source, kernel=kernel, prefer=prefer)
    return module, module.prepare(w.device, dtype or w.dtype)


def quantize_int4(
    model: nn.Module,
    *,
    group_size: int = 32,
    gguf_path: Path | str | None = None,
    include_lm_head: bool = True,
    kernel: str = "auto",
    prefer: str = "",
) -> nn.Module:
    """Replace the model's `nn.Linear` layers with `Int4Linear` (kernel settings `kernel`,
    `prefer`), in place, and return the model.

    With ``gguf_path``, each layer whose GGUF tensor is Q4_0 / Q4_1 with this group size takes
    the GGUF's own blocks (for a model loaded from that GGUF, exactly the weights it has); any
    other is quantized with `Int4Weight.from_float`; ``source`` records which. A tied head is
    untied as in `quantize_int8`. Kernels are prepared for the input embedding's dtype. A
    draft should keep ``include_lm_head=False``: a 4-bit head costs acceptance
    (docs/performance.md#int4-draft-output-head).
    """
    get_out = getattr(model, "get_output_embeddings", None)
    lm_head = get_out() if callable(get_out) else None
    get_in = getattr(model, "get_input_embeddings", None)
    embed = get_in() if callable(get_in) else None
    tied = lm_head is not None and embed is not None
    tied = tied and getattr(lm_head, "weight", None) is getattr(embed, "weight", None)
    config = getattr(model, "config", None)
    if gguf_path is not None and config is None:
        raise InvalidArgumentError("quantize_int4: a GGUF source needs the model's config (head counts)")
    gguf_weights = gguf_int4_weights(gguf_path, config) if gguf_path is not None else {}

    targets = [
        name for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and (include_lm_head or module is not lm_head)
    ]
    dtype = embed.weight.dtype if embed is not None else None
    sources: list[str] = []
    kernels: dict[str, int] = {}
    for name in targets:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        module, chosen = _int4_linear(getattr(parent, child_name), name, gguf_weights.get(f"{name}.weight"),
                                      gguf_path, group_size, kernel, prefer, dtype)
        kernels[chosen] = kernels.get(chosen, 0) + 1
        sources.append(module.source)
        setattr(parent, child_name, module)

    mark_quantized(model, "int4", untied=tied and include_lm_head)
    log.debug("int4: %d linear layers, %d from GGUF blocks, kernels %s", len(targets), sources.count("gguf"), kernels)
    return model
