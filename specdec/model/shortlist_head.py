"""A quantized draft's output head in two passes: a coarse 4-bit pass over the whole
vocabulary, then the exact int8 head on the few tokens that pass ranked highest.

The output head of a small draft is a large share of its step, and a 4-bit head reads half
the bytes of an int8 one, but on its own it costs acceptance. Its ranking is good even where
its winner is wrong, so `ShortlistHead` re-scores its `shortlist` best tokens of every row with
the int8 head's own rows: a gather of a few rows, not a second pass over the matrix.

The draft's distribution q is then defined by these logits: int8 values on the shortlist,
int4 values elsewhere. Speculative decoding stays exact for any q, provided the draft samples
from the q it reports, which it does (docs/architecture.md#exactness-contract).

Whether it is faster depends on the device and its kernels (on CUDA the int4 module falls
back to a dequantized matrix), so the service times both at start-up
(`specdec.tuning.kernels.measure_head`) and keeps the faster. The coarse pass costs memory
besides the int8 head: its 4-bit codes twice (as stored and as packed) and its scales.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from specdec.model.int4_weight import Int4Weight
from specdec.model.quantize import Int8Linear
from specdec.model.quantize_int4 import Int4Linear

log = logging.getLogger(__name__)

#: Tokens per row that the exact head re-scores: the int8 head's winner was always among the
#: coarse pass's top 32 (docs/performance.md#shortlist-output-head).
DEFAULT_SHORTLIST = 32
#: Weights per scale of the coarse pass: the finest group the int4 kernels take.
COARSE_GROUP_SIZE = 32


class ShortlistHead(nn.Module):
    """``exact``'s logits on each row's `shortlist` best tokens by ``coarse``; ``coarse``'s elsewhere."""

    def __init__(self, exact: Int8Linear, coarse: Int4Linear, shortlist: int) -> None:
        super().__init__()
        if exact.bias is not None or coarse.bias is not None:
            raise ValueError("ShortlistHead takes heads without bias")
        if (coarse.out_features, coarse.in_features) != (exact.out_features, exact.in_features):
            raise ValueError(
                f"coarse head is {coarse.out_features}x{coarse.in_features}, "
                f"exact {exact.out_features}x{exact.in_features}"
            )
        if not 1 <= shortlist <= exact.out_features:
            raise ValueError(f"shortlist must be in [1, {exact.out_features}], got {shortlist}")
        self.exact, self.coarse, self.shortlist = exact, coarse, shortlist
        self.out_features, self.in_features = exact.out_features, exact.in_features

    @classmethod
    def from_int8(
        cls, exact: Int8Linear, shortlist: int = DEFAULT_SHORTLIST, group_size: int = COARSE_GROUP_SIZE, *,
        kernel: str = "auto", prefer: str = "",
    ) -> ShortlistHead:
        """The coarse pass quantized from the int8 head's own (dequantized) weight, computed by the
        int4 ``kernel`` (see `Int4Linear`)."""
        weight = Int4Weight.from_float(exact.dequantized_weight().float(), group_size)
        coarse = Int4Linear(weight, source="float", kernel=kernel, prefer=prefer)
        coarse.prepare(exact.weight_int8.device, exact.scales.dtype)
        return cls(exact, coarse, shortlist)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] -> [..., out], in the dtype of ``x``."""
        rows = x.reshape(-1, self.in_features)  # [n, in]
        logits = self.coarse(rows)  # [n, out]
        picked = logits.topk(self.shortlist, dim=-1).indices  # [n, s]
        weight = self.exact.weight_int8[picked].float()  # [n, s, in]
        scales = self.exact.scales[picked].float()  # [n, s]
        rescored = torch.bmm(weight, rows.float().unsqueeze(-1)).squeeze(-1) * scales  # [n, s]
        logits.scatter_(1, picked, rescored.to(logits.dtype))
        return logits.reshape(*x.shape[:-1], self.out_features)  # [..., out]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, shortlist={self.shortlist}"
