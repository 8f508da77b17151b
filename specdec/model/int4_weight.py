"""The 4-bit group-wise weight format shared by the int4 draft and the GGUF reader.

``w[o, i] ≈ scale[o, g] * q[o, i] + zero[o, g]`` with ``g = i // group_size`` and ``q`` an
unsigned 4-bit code: llama.cpp's Q4_1 form (Q4_0 is ``zero = -8 * scale``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Int4Weight:
    """One linear layer's weight as ``scale[o, g] * q[o, i] + zero[o, g]``, with ``g = i // group_size``.

    ``q`` keeps one 4-bit code per uint8 element (unpacked). This makes slicing, permuting rows and
    concatenating trivial. Modules pack the codes for their kernel.
    """

    q: torch.Tensor  # [out, in] uint8 in 0..15
    scales: torch.Tensor  # [out, in // group_size] fp32
    zeros: torch.Tensor  # [out, in // group_size] fp32
    group_size: int

    def __post_init__(self) -> None:
        if self.q.dtype != torch.uint8 or self.q.dim() != 2:
            raise ValueError(f"q must be a 2-D uint8 tensor, got {self.q.dtype} {tuple(self.q.shape)}")
        out, in_features = self.q.shape
        if self.group_size <= 0 or in_features % self.group_size:
            raise ValueError(f"group_size {self.group_size} must be positive and divide in_features {in_features}")
        groups = (out, in_features // self.group_size)
        for name in ("scales", "zeros"):
            t = getattr(self, name)
            if t.dtype != torch.float32 or tuple(t.shape) != groups:
                raise ValueError(f"{name} must be float32 of shape {list(groups)}, got {t.dtype} {list(t.shape)}")
        if self.q.numel() and int(self.q.max()) > 15:
            raise ValueError("q holds values above 15: not 4-bit codes")

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def in_features(self) -> int:
        return self.q.shape[1]

    @classmethod
    def from_float(cls, w: torch.Tensor, group_size: int = 32) -> Int4Weight:
        """Asymmetric min/max quantization per group: ``scale = (max - min) / 15``, ``zero = min``.

        Round-to-nearest keeps every weight within half a step (``scale / 2``) of its original.
        A constant group has ``scale = 0``: all its codes are 0, and ``zero`` holds the value exactly.
        """
        if w.dim() != 2 or not w.is_floating_point():
            raise ValueError(f"w must be a 2-D float tensor, got {w.dtype} {tuple(w.shape)}")
        out, in_features = w.shape
        if group_size <= 0 or in_features % group_size:
            raise ValueError(f"group_size {group_size} must be positive and divide in_features {in_features}")
        grouped = w.detach().float().reshape(out, -1, group_size)  # [out, groups, group_size]
        lo = grouped.amin(dim=-1)  # [out, groups]
        scales = (grouped.amax(dim=-1) - lo) / 15.0  # [out, groups]
        divisor = torch.where(scales == 0, 1.0, scales)[..., None]  # [out, groups, 1]
        q = torch.round((grouped - lo[..., None]) / divisor).clamp_(0, 15).to(torch.uint8)  # [out, groups, gs]
        return cls(q.reshape(out, in_features), scales, lo, group_size)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in]. It is computed as ``scale * q + zero``, the same sum as
        `gguf.quants` computes, so GGUF blocks dequantize bit for bit alike."""
        out, in_features = self.q.shape
        grouped = self.q.reshape(out, -1, self.group_size).float()  # [out, groups, group_size]
        return (grouped * self.scales[..., None] + self.zeros[..., None]).reshape(out, in_features)

    def permute_rows(self, perm: torch.Tensor) -> Int4Weight:
        """The weight with its output rows reordered: row ``o`` of the result is row ``perm[o]``.

        Groups run along the input dimension, so this is exact.
        """
        return Int4Weight(self.q[perm], self.scales[perm], self.zeros[perm], self.group_size)

    @classmethod
    def concat(cls, weights: list[Int4Weight]) -> Int4Weight:
        """Stack weights along the output dimension, e.g. to fuse q/k/v into one matmul.

        All weights need the same ``in_features`` and ``group_size``.
        """
        if not weights:
            raise ValueError("concat needs at least one weight")
        first = weights[0]
        for w in weights[1:]:
            if w.in_features != first.in_features or w.group_size != first.group_size:
                raise ValueError(
                    f"cannot concat in_features/group_size {w.in_features}/{w.group_size} "
                    f"with {first.in_features}/{first.group_size}"
                )
        return cls(
            torch.cat([w.q for w in weights]),
            torch.cat([w.scales for w in weights]),
            torch.cat([w.zeros for w in weights]),
            first.group_size,
        )
