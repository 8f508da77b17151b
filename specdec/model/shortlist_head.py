"""A quantized draft's output head in two passes: a coarse 4-bit pass over the whole
vocabulary, then the exact int8 head on the few tokens that pass ranked highest.

The output head of a small draft is a large share of its step. SmolLM2-135M's tied head is
49,152 × 576 weights, 28 MB in int8 against ~66 MB of int4 decoder weights (scales
included), and it took 1.6-2.0 ms of an 8.7 ms step (AMD EPYC Zen 4). A 4-bit
head reads half the bytes, but on its own it cost ~9 points of greedy agreement with the
target (0.90 against 0.97 teacher-forced). Its ranking is good even where its winner is
wrong, so `ShortlistHead` re-scores its `shortlist` best tokens of every row with the int8
head's own rows: a gather of a few rows, not a second pass over the matrix.

The draft's distribution q is then defined by these logits: int8 values on the shortlist,
int4 values elsewhere. Speculative decoding stays exact for any q, provided the draft samples
from the q it reports, which it does (DESIGN.md, "Exactness contract"). What a cheaper q may
cost is acceptance, and in measurement it cost none: over 1,004 teacher-forced positions
of 10 chat answers the argmax equalled the int8 head's at every one.

Whether it is faster depends on the device and its kernels (on CUDA the int4 module falls
back to a dequantized bf16 matrix, twice the int8 bytes), so `choose_head` times both at
start-up and keeps the faster. The coarse pass costs memory besides the int8 head: its
4-bit codes twice (as stored and as packed for the kernel) and its scales, 39 MB for
SmolLM2's head, about 1.4 times the int8 head.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from specdec.model.int4_weight import Int4Weight
from specdec.model.quantize import Int8Linear
from specdec.model.quantize_int4 import Int4Linear, min_time_ms
from specdec.model.threads import one_thread

log = logging.getLogger(__name__)

#: Tokens per row that the exact head re-scores. Over 1,004 teacher-forced positions the
#: int8 head's winner was always among the coarse pass's top 32.
DEFAULT_SHORTLIST = 32
#: Weights per scale of the coarse pass: the finest group the int4 kernel takes (64 read
#: 10 % fewer bytes and timed within 3 % of 32 on the Zen 4).
COARSE_GROUP_SIZE = 32


class ShortlistHead(nn.Module):
    """``exact``'s logits on each row's `shortlist` best tokens by ``coarse``; ``coarse``'s elsewhere."""

    def __init__(self, exact: Int8Linear, coarse: Int4Linear, shortlist: int) -> None:
        super().__init__()
        if exact.bias is not None or coarse.bias is not None:
            raise ValueError("ShortlistHead takes heads without bias")
        if (coarse.out_features, coarse.in_features) != (exact.out_features, exact.in_features):
            raise ValueError(
                f"coarse head is {coarse.out_features}x{coarse.in_features}, exact {exact.out_features}x{exact.in_features}"
            )
        if not 1 <= shortlist <= exact.out_features:
            raise ValueError(f"shortlist must be in [1, {exact.out_features}], got {shortlist}")
        self.exact, self.coarse, self.shortlist = exact, coarse, shortlist
        self.out_features, self.in_features = exact.out_features, exact.in_features

    @classmethod
    def from_int8(
        cls, exact: Int8Linear, shortlist: int = DEFAULT_SHORTLIST, group_size: int = COARSE_GROUP_SIZE, *, kernel: str = "auto"
    ) -> ShortlistHead:
        """The coarse pass quantized from the int8 head's own (dequantized) weight, computed by the
        int4 ``kernel`` (see `Int4Linear`)."""
        weight = Int4Weight.from_float(exact.dequantized_weight().float(), group_size)
        coarse = Int4Linear(weight, source="float", kernel=kernel)
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


def choose_head(exact: Int8Linear, shortlist: int, *, kernel: str = "auto") -> nn.Module:
    """``exact``, or a `ShortlistHead` over it (its coarse pass on the int4 ``kernel``) if that
    computes one and four rows faster here.

    Timed on one thread, as `specdec.model.quantize_int4.choose_int4_kernel` times its
    kernels: per-core speed ranks them, and a second thread only adds the other process's
    stalls to the comparison.
    """
    if shortlist <= 0:
        return exact
    candidate = ShortlistHead.from_int8(exact, min(shortlist, exact.out_features), kernel=kernel)
    x = torch.randn(4, exact.in_features, generator=torch.Generator().manual_seed(0))
    x = x.to(device=exact.weight_int8.device, dtype=exact.scales.dtype)  # [rows, in]

    def timed(head: nn.Module) -> float:
        # `.item()` waits for the result, so an asynchronous device (CUDA) is timed too.
        return min_time_ms(lambda: (head(x[:1]).sum().item(), head(x).sum().item()))

    with one_thread(), torch.inference_mode():
        exact_ms, shortlist_ms = timed(exact), timed(candidate)
    chosen = candidate if shortlist_ms < exact_ms else exact
    log.info(
        "output head: %s (1 thread, 1 + 4 rows: int8 %.2f ms, int4 pass + int8 on the best %d %.2f ms)",
        "shortlist" if chosen is candidate else "int8", exact_ms, candidate.shortlist, shortlist_ms,
    )
    return chosen
