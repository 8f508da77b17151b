"""A lookup's proposal: tokens copied from text already seen, and how much to trust them."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from specdec.gateway.draft_sources import DraftSource
from specdec.prompt_lookup import common_prefix_length


@dataclass(frozen=True)
class LookupDraft:
    """Up to K tokens that followed the request's last `match_len` tokens somewhere else.

    A lookup is a deterministic draft: its q is one-hot on each token, so verifying it keeps
    the target's distribution exactly (docs/architecture.md#exactness-contract).
    """

    tokens: tuple[int, ...]
    source: DraftSource
    #: How many of the request's last tokens matched: a longer match is likelier to continue alike.
    match_len: int
    #: The share of the matched context's continuations that start with `tokens[0]` (1.0 for
    #: prompt lookup, which proposes the most recent continuation).
    frequency: float = 1.0

    @property
    def score(self) -> tuple[int, float]:
        """Match length first, then frequency: the better of two proposals has the greater score."""
        return self.match_len, self.frequency

    def truncated(self, k: int) -> LookupDraft:
        """The first `k` tokens of this proposal."""
        return self if k >= len(self.tokens) else replace(self, tokens=self.tokens[:k])

    def through_stop(self, stop_token_ids: Collection[int]) -> LookupDraft:
        """This proposal up to and including its first stop token: no token after one could be kept."""
        cut = next((j + 1 for j, token in enumerate(self.tokens) if token in stop_token_ids), len(self.tokens))
        return self.truncated(cut)

    def agreeing(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of this proposal equal `tokens`, position by position."""
        return common_prefix_length(self.tokens, tokens)


def match_class(match_len: int) -> int:
    """The match lengths whose lookups share an acceptance estimate: 1, 2 and 3 alone, then
    powers of two (4-7, 8-15, 16-31, 32 and more). Long matches are rarer and change little
    with a few more tokens, so pooling them keeps each estimate fed."""
    return match_len if match_len < 4 else min(1 << (match_len.bit_length() - 1), 32)
