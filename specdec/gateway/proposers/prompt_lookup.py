"""Prompt lookup: propose what followed the request's last n tokens earlier in its own text.

The index maps every n-gram of the request's prompt and output, for n from `min_n` to
`max_n`, to where its most recent continuation starts, and grows with the tokens each round
adds, so a lookup is `max_n - min_n + 1` dictionary probes whatever the length of the text.
The longest n that matches wins: a longer match is likelier to go on alike.
"""

from __future__ import annotations

from specdec.gateway.draft_sources import DraftSource
from specdec.gateway.proposers.draft import LookupDraft


class PromptLookupIndex:
    """The n-grams of one request's tokens, each pointing at its latest continuation."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        #: tables[n - min_n]: n-gram → index of the token that followed its latest occurrence.
        self._tables: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        #: Continuations starting before this index are in the tables.
        self._indexed = 0

    def update(self, tokens: list[int]) -> None:
        """Index the continuations that `tokens` has gained since the last call (tokens only grow)."""
        min_n, tables = self.min_n, self._tables
        for start in range(max(self._indexed, min_n), len(tokens)):
            window = tuple(tokens[max(0, start - self.max_n) : start])  # up to max_n tokens before `start`
            for n in range(min_n, len(window) + 1):
                tables[n - min_n][window[-n:]] = start
        self._indexed = max(self._indexed, len(tokens))

    def propose(self, tokens: list[int], k: int) -> LookupDraft | None:
        """Up to `k` tokens after the latest earlier occurrence of the longest matching suffix of
        `tokens` (indexed up to their end by `update`); None when no n-gram of at least `min_n` matches."""
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = self._tables[n - self.min_n].get(tuple(tokens[-n:]))
            if start is not None:
                return LookupDraft(copy_forward(tokens, start, k), DraftSource.PROMPT_LOOKUP, n)
        return None


def copy_forward(tokens: list[int], start: int, k: int) -> tuple[int, ...]:
    """`k` tokens from `tokens[start]` on, where a copy that runs past the end goes on copying
    what it has just copied (a repeating text repeats on): `start` must be < len(tokens)."""
    out: list[int] = []
    length = len(tokens)
    for source in range(start, start + k):
        out.append(tokens[source] if source < length else out[source - length])
    return tuple(out)
