"""Prompt lookup: propose what followed the request's last tokens earlier in its own text.

The index maps every n-gram of the request's prompt and output, for n from `min_n` to
`max_n`, to where its continuations start, and grows with the tokens each round adds. A
lookup takes the longest n that matches, then measures each of that n-gram's
`candidates` most recent occurrences backward: how many tokens before it equal the
request's last tokens, up to `max_match_len`. The occurrence with the longest real match
wins, the most recent on a tie: a text repeats its openings (code lines, table rows, JSON
objects share their first tokens), so a short n-gram alone points at the latest of many
look-alikes, while the real match length tells a copy in progress from a coincidence. That
length is the match's `match_len`, which the K planner's acceptance estimates are kept by.

The gateway looks up proposals with it (`specdec.gateway.proposers`), and the draft service
guesses its own next tokens with it while it drafts (`specdec.draft_server.engine`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

#: n-gram lengths matched, from the longest down.
MIN_N, MAX_N = 1, 4
#: Recent occurrences of the matched n-gram measured backward, each up to `MAX_MATCH_LEN` tokens.
CANDIDATES, MAX_MATCH_LEN = 8, 64


class LookupMatch(NamedTuple):
    """Up to k tokens that followed an earlier occurrence of the text's last `match_len` tokens."""

    tokens: tuple[int, ...]
    match_len: int
    #: Where the copied tokens start in the text: the copy continues from there.
    start: int


class PromptLookupIndex:
    """The n-grams of one request's tokens, each pointing at its recent continuations."""

    def __init__(
        self, min_n: int = MIN_N, max_n: int = MAX_N, *, candidates: int = CANDIDATES,
        max_match_len: int = MAX_MATCH_LEN,
    ) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.candidates, self.max_match_len = candidates, max(max_match_len, max_n)
        #: tables[n - min_n]: n-gram → index of the token that followed its latest occurrence.
        self._tables: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        #: earlier[n - min_n][i]: where the n-gram before index i was followed before that (-1:
        #: nowhere), so a table entry heads a chain of its occurrences, newest first. Flat lists
        #: of ints rather than a list per n-gram: thousands of small lists slow the garbage collector.
        self._earlier: list[list[int]] = [[] for _ in range(min_n, max_n + 1)]
        #: Continuations starting before this index are in the tables.
        self._indexed = 0

    def update(self, tokens: list[int]) -> None:
        """Index the continuations that `tokens` has gained since the last call (tokens only grow)."""
        min_n, tables, earlier = self.min_n, self._tables, self._earlier
        for start in range(self._indexed, len(tokens)):
            window = tuple(tokens[max(0, start - self.max_n) : start])  # up to max_n tokens before `start`
            for n in range(min_n, self.max_n + 1):
                if n > len(window):
                    earlier[n - min_n].append(-1)
                    continue
                table, key = tables[n - min_n], window[-n:]
                earlier[n - min_n].append(table.get(key, -1))
                table[key] = start
        self._indexed = max(self._indexed, len(tokens))

    @property
    def indexed(self) -> int:
        """How many leading tokens of the text the tables cover."""
        return self._indexed

    def propose(self, tokens: list[int], k: int) -> LookupMatch | None:
        """Up to `k` tokens after the earlier occurrence of `tokens`' longest matching n-gram
        whose real match is longest (indexed up to their end by `update`); None when no
        n-gram of at least `min_n` tokens matches."""
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = self._tables[n - self.min_n].get(tuple(tokens[-n:]), -1)
            if start < 0:
                continue
            earlier, best_start, best_len = self._earlier[n - self.min_n], start, 0
            for _ in range(self.candidates):  # newest first: it wins ties
                length = match_length(tokens, start, n, self.max_match_len)
                if length > best_len:
                    best_start, best_len = start, length
                start = earlier[start]
                if start < 0 or best_len == self.max_match_len:
                    break
            return LookupMatch(copy_forward(tokens, best_start, k), best_len, best_start)
        return None


def match_length(tokens: list[int], end: int, known: int, limit: int) -> int:
    """How many tokens before index `end` equal the last tokens of `tokens`: at least `known`
    (the caller matched those), at most `limit` and `end`. Equal slices of length m imply equal
    slices of every shorter length, so a doubling then a binary search over slice comparisons
    finds it in O(log limit) comparisons."""
    length = len(tokens)
    low, high = known, min(limit, end)
    while low < high:
        probe = min(high, 2 * max(low, 1))
        if tokens[end - probe : end] != tokens[length - probe :]:
            high = probe - 1
            break
        low = probe
    while low < high:
        middle = (low + high + 1) // 2
        if tokens[end - middle : end] == tokens[length - middle :]:
            low = middle
        else:
            high = middle - 1
    return low


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens of `a` and `b` are equal, position by position."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def copy_forward(tokens: list[int], start: int, k: int) -> tuple[int, ...]:
    """`k` tokens from `tokens[start]` on, where a copy that runs past the end goes on copying
    what it has just copied (a repeating text repeats on): `start` must be < len(tokens)."""
    out: list[int] = []
    length = len(tokens)
    for source in range(start, start + k):
        out.append(tokens[source] if source < length else out[source - length])
    return tuple(out)
