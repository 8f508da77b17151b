"""Domain forms of the per-request items of the batched model-service rpcs.

The services validate and execute these; the gateway builds them. Protobuf conversion
lives in `specdec.serving.convert`, so neither side touches generated classes directly.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.sampling.params import SamplingParams


@dataclass(frozen=True)
class PrefillItem:
    """Target Prefill: allocate `slot_id` and run its prompt."""

    slot_id: str
    prompt_tokens: list[int]


@dataclass(frozen=True)
class VerifyItem:
    """Target Verify: roll back to `valid_len`, then score `tokens` = [g, t1 .. tK]."""

    slot_id: str
    valid_len: int
    tokens: list[int]


@dataclass(frozen=True)
class ProposeItem:
    """Draft Propose: roll back to `valid_len`, feed `new_tokens`, draft `k` tokens."""

    slot_id: str
    valid_len: int
    new_tokens: list[int]
    num_speculative_tokens: int
    sampling: SamplingParams
