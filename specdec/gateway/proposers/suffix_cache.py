"""Suffix proposals across requests: what most often followed the same tokens in recent outputs.

Answers to similar requests share long runs (templates, code idioms, JSON keys, boilerplate);
this cache counts, for every n-gram of recent outputs (n from `min_n` to `max_n`), the tokens
that followed it. A proposal starts from the longest n-gram that ends the request's text,
takes its most frequent continuation, and goes on token by token while the most frequent
continuation holds at least `min_share` of its context's counts.

Memory is bounded: the cache holds at most `capacity` recorded tokens, and recording more
forgets the oldest first (their counts are taken back).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from specdec.gateway.draft_sources import DraftSource
from specdec.gateway.proposers.draft import LookupDraft

#: A proposal goes on while its next token holds this share of its context's counts.
MIN_SHARE = 0.5


@dataclass
class _Continuations:
    """The tokens seen after one context, with their counts."""

    counts: dict[int, int]
    total: int = 0
    #: The most frequent token and its count, kept up to date as counts grow; None after the
    #: leader lost a count (found again when asked: a common context has thousands of tokens).
    _leader: tuple[int, int] | None = None

    def add(self, token: int, delta: int) -> None:
        """Count `token` once more (delta +1) or once less (-1)."""
        self.total += delta
        count = self.counts.get(token, 0) + delta
        if count:
            self.counts[token] = count
        else:
            del self.counts[token]
        if delta > 0 and self._leader is not None and (self._leader[0] == token or count > self._leader[1]):
            self._leader = (token, count)
        elif delta < 0 and self._leader is not None and self._leader[0] == token:
            self._leader = None

    def best(self) -> tuple[int, float]:
        """The most frequent next token and its share of the total."""
        if self._leader is None:
            self._leader = max(self.counts.items(), key=lambda item: item[1])
        token, count = self._leader
        return token, count / self.total


class SuffixCache:
    """n-gram → continuation counts over the most recent `capacity` output tokens of all requests."""

    def __init__(self, capacity: int, min_n: int, max_n: int, min_share: float = MIN_SHARE) -> None:
        self.capacity, self.min_n, self.max_n, self.min_share = capacity, min_n, max_n, min_share
        #: tables[n - min_n]: context of n tokens → its continuations.
        self._tables: list[dict[tuple[int, ...], _Continuations]] = [{} for _ in range(min_n, max_n + 1)]
        #: (longest context, next token) of every recorded token, oldest first.
        self._recorded: collections.deque[tuple[tuple[int, ...], int]] = collections.deque()

    def __len__(self) -> int:
        """Recorded tokens (at most `capacity`)."""
        return len(self._recorded)

    def add(self, context: list[int], output: list[int]) -> None:
        """Record one request's `output`, each token under the n-grams before it; the output's
        first tokens take their contexts from the end of `context` (the prompt)."""
        if self.capacity <= 0:
            return
        text = context[-self.max_n :] + output
        for i in range(len(text) - len(output), len(text)):
            longest = tuple(text[max(0, i - self.max_n) : i])
            if len(longest) < self.min_n:
                continue
            self._count(longest, text[i], +1)
            self._recorded.append((longest, text[i]))
        while len(self._recorded) > self.capacity:
            self._count(*self._recorded.popleft(), -1)

    def _count(self, longest: tuple[int, ...], token: int, delta: int) -> None:
        for n in range(self.min_n, len(longest) + 1):
            table, context = self._tables[n - self.min_n], longest[-n:]
            seen = table.get(context)
            if seen is None:
                seen = table[context] = _Continuations({}, 0, (token, 0))
            seen.add(token, delta)
            if not seen.counts:
                del table[context]

    def _longest_match(self, tokens: list[int] | tuple[int, ...]) -> tuple[int, _Continuations] | None:
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            seen = self._tables[n - self.min_n].get(tuple(tokens[-n:]))
            if seen is not None:
                return n, seen
        return None

    def propose(self, tokens: list[int], k: int) -> LookupDraft | None:
        """Up to `k` tokens continuing `tokens` as recent outputs most often did; None when no
        context of at least `min_n` tokens was seen, or its most frequent continuation holds less
        than `min_share`. Its score is the first token's match length and share."""
        match = self._longest_match(tokens)
        if match is None or k <= 0:
            return None
        match_len, seen = match
        first, share = seen.best()
        if share < self.min_share:
            return None
        out = [first]
        window = list(tokens[-self.max_n :]) + out
        while len(out) < k:
            step = self._longest_match(window[-self.max_n :])
            if step is None:
                break
            token, step_share = step[1].best()
            if step_share < self.min_share:
                break
            out.append(token)
            window.append(token)
        return LookupDraft(tuple(out), DraftSource.SUFFIX, match_len, share)
