"""Int8 weight-only quantization of a loaded `transformers` causal LM (the "quantized self-draft").

Each weight row gets one symmetric scale, ``absmax / 127``. Activations stay in the model dtype.
The fast path is `torch._weight_int8pack_mm`:

- On CPU only bfloat16 has a vectorised kernel, faster than a bf16 `F.linear`; float32 and
  float16 run a scalar loop slower than `F.linear`, so those dtypes take the fallback
  (docs/performance.md#int8-weight-kernel).
- ``scales`` must have the same dtype as ``x``. ``x`` must be 2-D and contiguous in its last
  dimension, and the int8 weight must be contiguous.

The fallback dequantises on the fly: ``F.linear(x, w_int8.to(x.dtype)) * scales``. It works on
any device and dtype; CUDA always uses it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

# Dtypes where `_weight_int8pack_mm` beats F.linear on CPU (see the module docstring).
_FAST_DTYPES = frozenset({torch.bfloat16})


@functools.cache
def int8pack_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether the fast kernel is used for this (device type, dtype); probed once and cached."""
    if device_type != "cpu" or dtype not in _FAST_DTYPES or not hasattr(torch, "_weight_int8pack_mm"):
        return False
    x = torch.ones(2, 64, dtype=dtype)  # [rows, in]
    w = torch.ones(8, 64, dtype=torch.int8)  # [out, in]
    try:
        y = torch._weight_int8pack_mm(x, w, torch.full((8,), 0.5, dtype=dtype))  # [rows, out]
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.allclose(y.float(), torch.full((2, 8), 32.0)))


def int8_matmul(x: torch.Tensor, weight_int8: torch.Tensor, scales: torch.Tensor, *, fast: bool) -> torch.Tensor:
    """``x @ (weight_int8 * scales[:, None]).T`` for 2-D ``x`` [rows, in]; returns [rows, out]."""
    scales = scales.to(x.dtype)
    if fast:
        return torch._weight_int8pack_mm(x.contiguous(), weight_int8, scales)  # [rows, out]
    return F.linear(x, weight_int8.to(x.dtype)) * scales  # [rows, out]


class Int8Linear(nn.Module):
    """A drop-in replacement for `nn.Linear` that stores an int8 weight with one scale per output channel.

    The tensors are registered as buffers, not parameters, so ``module.to(dtype)`` casts
    ``scales`` and ``bias`` but leaves ``weight_int8`` as int8. The module has no ``.weight``
    attribute.
    """

    weight_int8: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight_int8.dtype != torch.int8 or weight_int8.dim() != 2:
            raise ValueError(
                f"weight_int8 must be a 2-D int8 tensor, got {weight_int8.dtype} {tuple(weight_int8.shape)}"
            )
        if scales.shape != weight_int8.shape[:1]:
            raise ValueError(f"scales must have shape [{weight_int8.shape[0]}], got {tuple(scales.shape)}")
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8.contiguous())  # [out, in] int8
        self.register_buffer("scales", scales)  # [out], activation dtype
        self.register_buffer("bias", bias)  # [out] or None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """Quantise ``linear.weight`` with a symmetric absmax scale per row; scales keep its dtype."""
        w = linear.weight.detach()  # [out, in]
        scales = (w.float().abs().amax(dim=1) / 127.0).to(w.dtype)  # [out]
        # Quantise with the scales as stored, so a bf16 scale's rounding is accounted for.
        divisor = torch.where(scales == 0, 1.0, scales.float())[:, None]  # [out, 1]
        q = torch.round(w.float() / divisor).clamp_(-127, 127).to(torch.int8)  # [out, in]
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scales, bias)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight this module effectively multiplies by, in the scales' dtype: [out, in]."""
        return self.weight_int8.to(self.scales.dtype) * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] -> [..., out], in the dtype of ``x``."""
        x_2d = x.reshape(-1, self.in_features)  # [tokens, in]
        fast = int8pack_mm_supported(x.device.type, x.dtype)
        y = int8_matmul(x_2d, self.weight_int8, self.scales, fast=fast)  # [tokens, out]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)  # [..., out]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_int8(model: nn.Module, *, include_lm_head: bool = True) -> nn.Module:
    """Replace the model's `nn.Linear` layers with `Int8Linear`, in place, and return the model.

    Norms and embeddings stay at full precision; ``lm_head`` is quantised only with
    ``include_lm_head``. Quantising a tied ``lm_head`` unties it: the embedding keeps its
    full-precision weight for lookup, ``lm_head`` gets an int8 copy (see `mark_quantized`).
    """
    get_out = getattr(model, "get_output_embeddings", None)
    lm_head = get_out() if callable(get_out) else None
    get_in = getattr(model, "get_input_embeddings", None)
    embed = get_in() if callable(get_in) else None
    tied = (
        lm_head is not None and embed is not None
        and getattr(lm_head, "weight", None) is getattr(embed, "weight", None)
    )

    targets = [
        name for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and (include_lm_head or module is not lm_head)
    ]
    for name in targets:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child_name, Int8Linear.from_linear(getattr(parent, child_name)))

    mark_quantized(model, "int8", untied=tied and include_lm_head)
    return model


def mark_quantized(model: nn.Module, scheme: str, *, untied: bool) -> None:
    """Record the quantization in the model's config; when the output head was quantized
    away from a tied input embedding, untie them in the config so `transformers` does not
    tie them back."""
    config = getattr(model, "config", None)
    if config is None:
        return
    if untied:
        config.tie_word_embeddings = False
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        text_config.tie_word_embeddings = False
    config.specdec_quantization = scheme
