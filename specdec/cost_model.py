"""The speed model of speculative decoding: what a round costs and what it yields.

A round with K draft tokens costs K draft steps plus one (K+1)-token verify, and emits
1 + Σ_{i=1..K} Π_{j≤i} α_j tokens on average, where α_j is the chance that draft token j
is accepted given tokens 1..j-1 were (Leviathan et al. 2023, Thm 3.8, with per-position
acceptance and a measured verify cost instead of a free one; docs/architecture.md#speed-model).
Plain decoding is K = 0. Costs come from the services' own start-up measurements (`ForwardCost`),
so the model holds on whatever hardware they run.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ForwardCost:
    """Seconds one forward took over `batch_size` requests of `tokens` new tokens each, each
    request with `context` tokens cached before them (0: not reported, taken as short)."""

    batch_size: int
    tokens: int
    seconds: float
    context: int = 0

    @classmethod
    def from_pb(cls, message: Any) -> ForwardCost:
        """From a `specdec.v1.ForwardCost` message (duck-typed: this module imports no wire code)."""
        return cls(message.batch_size, message.tokens, message.seconds, message.context_tokens)


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), extended linearly past both ends; xs ascending."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]  # a single point: assume cost proportional to size
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


#: Chunks of 2 up to this many tokens per request are verify-sized: within a batch size
#: their costs are smoothed by a least-squares line (see `_smoothed`). A 1-token step and
#: longer chunks (a prompt-sized prefill) are kept as measured.
VERIFY_MAX_TOKENS = 17


def _smoothed(tokens: Sequence[int], seconds: Sequence[float]) -> list[float]:
    """`seconds` at ascending `tokens`, the verify-sized ones replaced by their least-squares
    line when there are at least three, then made non-decreasing.

    A forward over more tokens never costs less, and one more verified token costs about the
    same at any K, but a single start-up timing is noisy; raw, one outlier bends the verify slope
    the K planner compares (docs/performance.md#cost-table-smoothing). The 1-token step stays as
    measured: a small forward is bound by reading the weights, and a line through the wider
    chunks misses it.
    """
    out = list(seconds)
    short = [i for i, t in enumerate(tokens) if 2 <= t <= VERIFY_MAX_TOKENS]
    if len(short) >= 3:
        xs, ys = [float(tokens[i]) for i in short], [seconds[i] for i in short]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
        for i, x in zip(short, xs):
            out[i] = mean_y + max(slope, 0.0) * (x - mean_x)
    for i in range(1, len(out)):
        out[i] = max(out[i], out[i - 1])
    return out


def _context_slopes(
    costs: Sequence[ForwardCost], base: dict[tuple[int, int], float], base_context: int, context: int
) -> dict[int, float]:
    """Seconds each cached context token adds to a forward, per request, by tokens per request,
    at `context`: the extra seconds of that context's points over their extra
    context-token-requests, pooled over batch sizes so the large batches (well above the timing
    noise) carry it. Attention reads every cached token (docs/performance.md#context-cost).
    """
    extra: dict[int, float] = {}
    weight: dict[int, float] = {}
    for cost in costs:
        if cost.context == context and (cost.batch_size, cost.tokens) in base:
            extra[cost.tokens] = extra.get(cost.tokens, 0.0) + cost.seconds - base[(cost.batch_size, cost.tokens)]
            weight[cost.tokens] = weight.get(cost.tokens, 0.0) + cost.batch_size * (cost.context - base_context)
    return {t: max(0.0, extra[t] / weight[t]) for t in sorted(extra)}


@dataclass(frozen=True)
class _ContextLevel:
    """The context slopes measured at one longer context: seconds per cached token and request,
    by tokens per request (ascending)."""

    context: int
    tokens: list[float]
    slopes: list[float]

    def slope(self, tokens: float) -> float:
        """The slope for a chunk of `tokens`. Past the widest chunk measured, each of a chunk's
        tokens reads the context at that chunk's cost per token: a line through the slopes would
        grow with the square of a prompt-sized chunk."""
        widest = self.tokens[-1]
        if tokens > widest:
            return self.slopes[-1] * tokens / widest
        if len(self.slopes) == 1:
            return self.slopes[0]
        return _interpolate(self.tokens, self.slopes, tokens)


class CostTable:
    """Forward-pass seconds for any (batch size, tokens per request, cached context), from a
    grid measured at one short context: linear in tokens within a batch size (rows smoothed by
    `_smoothed`), then linear in batch size, extended past the grid; plus a cost linear in the
    batch's cached tokens where the grid has long-context points (`_context_slopes`), piecewise
    linear where it has them at more than one context.
    """

    def __init__(self, costs: Sequence[ForwardCost], scale: float = 1.0) -> None:
        if not costs:
            raise ValueError("a cost table needs at least one measurement")
        #: The context the grid was measured at: the shortest reported.
        self.base_context = min(cost.context for cost in costs)
        base = {(c.batch_size, c.tokens): c.seconds for c in costs if c.context == self.base_context}
        rows: dict[int, dict[int, float]] = {}
        for (batch, tokens), seconds in base.items():
            rows.setdefault(batch, {})[tokens] = seconds
        self._batches = sorted(rows)
        self._rows = {}
        for b in self._batches:
            widths = sorted(rows[b])
            self._rows[b] = (widths, _smoothed(widths, [rows[b][t] for t in widths]))
        #: The longer contexts measured, shortest first, each with its slopes.
        self._levels: list[_ContextLevel] = []
        for context in sorted({c.context for c in costs if c.context > self.base_context}):
            slopes = _context_slopes(costs, base, self.base_context, context)
            if slopes:
                self._levels.append(_ContextLevel(context, [float(t) for t in slopes], list(slopes.values())))
        #: Correction factor applied to every figure (measured online ÷ measured at start-up).
        self.scale = scale
        #: Mean cached tokens per request that `seconds` prices (the base context by default).
        self.context = float(self.base_context)
        #: Rows of the priced forward per row asked (`shared`; 1: the forward is the caller's own).
        self.rows_factor = 1.0
        #: Unscaled seconds per (batch size, tokens) asked so far, shared by the scaled copies:
        #: a plan asks for the same few points many times over.
        self._memo: dict[tuple[float, float], float] = {}

    @property
    def has_context_term(self) -> bool:
        """Whether the table knows how its costs grow with the context."""
        return bool(self._levels)

    def scaled(self, factor: float) -> CostTable:
        """The same table with every figure multiplied by `factor` (sharing the smoothed
        rows: the planner asks for one every round)."""
        table = self._clone()
        table.scale = factor
        return table

    def at_context(self, context: float) -> CostTable:
        """The same table pricing forwards whose requests hold `context` cached tokens on average."""
        table = self._clone()
        table.context = context
        return table

    def shared(self, rows_factor: float) -> CostTable:
        """The same table pricing forwards that carry `rows_factor` times the rows asked for:
        a service that merges several gateways' calls runs them as one forward, and a caller's
        round lasts that forward. The other rows are priced as the caller's own (their tokens
        per row the same)."""
        table = self._clone()
        table.rows_factor = rows_factor
        return table

    def _clone(self) -> CostTable:
        """A shallow copy (the planner makes several a round: `copy.copy` took most of their time)."""
        table = object.__new__(CostTable)
        table.__dict__.update(self.__dict__)
        return table

    def context_seconds(self, batch_size: float, tokens: float) -> float:
        """Unscaled seconds the context beyond the base one adds to a forward (negative below it).
        Per request it is piecewise linear in the context, through each measured context's extra
        seconds and on past the longest along its last piece: once the cached keys and values
        outgrow the CPU's caches each one costs more (docs/performance.md#context-cost)."""
        if not self._levels or self.context == self.base_context:
            return 0.0
        x0, y0, slope = float(self.base_context), 0.0, 0.0
        for level in self._levels:
            y1 = max(y0, level.slope(tokens) * (level.context - self.base_context))
            slope = (y1 - y0) / (level.context - x0)
            if self.context <= level.context:
                break
            x0, y0 = float(level.context), y1
        return batch_size * (y0 + slope * (self.context - x0))

    def seconds(self, batch_size: float, tokens: float) -> float:
        batch_size *= self.rows_factor
        key = (batch_size, tokens)
        unscaled = self._memo.get(key)
        if unscaled is None:
            per_batch = [_interpolate(*self._rows[b], tokens) for b in self._batches]
            unscaled = self._memo[key] = _interpolate(self._batches, per_batch, batch_size)
        return self.scale * max(0.0, unscaled + self.context_seconds(batch_size, tokens))

    @property
    def widest_chunk(self) -> int:
        """Tokens of the widest forward measured for one request: past it, `seconds` extrapolates."""
        return self._rows[self._batches[0]][0][-1]

    def step(self, batch_size: float = 1) -> float:
        """One 1-token decode step over `batch_size` requests."""
        return self.seconds(batch_size, 1)

    def width_seconds(self) -> float:
        """What one more token of width adds to a forward of one request: the slope over the
        widths a round's forwards have (2 to 9 tokens)."""
        return (self.seconds(1, 9) - self.seconds(1, 2)) / 7


def expected_tokens(alphas: Sequence[float], k: int) -> float:
    """Mean tokens a round emits with `k` draft tokens: accepted ones plus the recovered or bonus one.

    `alphas[j]` is the acceptance probability of draft position j+1 given the earlier ones
    were accepted; positions past the list reuse its last entry.
    """
    if len(alphas) == 1 and alphas[0] != 1.0:  # one α for every position: the geometric sum
        return (1.0 - alphas[0] ** (k + 1)) / (1.0 - alphas[0])
    total, survive = 1.0, 1.0
    for j in range(k):
        survive *= alphas[min(j, len(alphas) - 1)] if alphas else 0.0
        total += survive
    return total


def expected_speedup(alpha: float, k: int, c: float, s: float) -> float:
    """S(K) = [(1−α^(K+1))/(1−α)] / (K·c + 1 + K·s) for one request.

    `c` is a draft step ÷ a target step, `s` the extra cost of each verified token ÷ a
    target step. This is the closed form of `expected_tokens` for a constant α.
    """
    return expected_tokens([alpha], k) / (k * c + 1 + k * s)


def _one_token_steps(table: CostTable, lengths: Sequence[float], first: int) -> float:
    """Seconds of one-token steps `first`, `first` + 1, ... up to the longest of `lengths`,
    step j batching the requests whose length is at least j. A fractional length (an expected
    one) takes part in its last step by its fraction."""
    total = 0.0
    for j in range(first, math.ceil(max(lengths, default=0)) + 1):
        rows = sum(min(1.0, max(0.0, n - j + 1)) for n in lengths)
        total += table.step(rows) if rows >= 1 else rows * table.step(1)
    return total


@dataclass(frozen=True)
class RoundCostModel:
    """Seconds of one round for a batch, from both services' tables plus a fixed overhead.

    `overhead_s` is what a plain round costs besides the target's compute (the Verify RPC,
    (de)serialisation, acceptance, scheduling). A round that drafts adds
    `draft_round_overhead_s` (the Propose RPC) plus `draft_token_overhead_s` per draft
    token (q vectors and logits rows on the wire, the rejection sampler). All three are
    measured online by the gateway; without the draft's share a cheap, mostly rejected draft
    looks free (docs/performance.md#draft-overhead-in-the-round-cost).

    A request whose `lookup` flag is set verifies k tokens that a lookup proposed: they cost
    the verify its width and `lookup_token_overhead_s` each, and no draft step. One the draft
    model drafts for with a lookup's guess feeds the guess in its first forward and skips a
    step for each guessed token it draws too (`draft_seconds`); where the draft also guesses on
    its own, the tokens it feeds widen its later steps (`widened`).
    """

    target: CostTable
    draft: CostTable | None
    overhead_s: float = 0.0
    draft_round_overhead_s: float = 0.0
    draft_token_overhead_s: float = 0.0
    lookup_token_overhead_s: float = 0.0

    def round_seconds(
        self, ks: Sequence[int], feeds: Sequence[int] | None = None, steps: Sequence[int] | None = None,
        lookup: Sequence[bool] | None = None, saved: Sequence[float] | None = None,
        widened: Sequence[float] | None = None,
    ) -> float:
        """A round where request i drafts ks[i] tokens (0 = plain decoding for it) after
        feeding the draft feeds[i] tokens (see `draft_seconds`, also for `saved` and `widened`), or verifies
        ks[i] tokens a lookup proposed where lookup[i], or, when every K is 0, decodes steps[i]
        tokens (see `verify_seconds`)."""
        drafts = model_ks(ks, lookup)
        drafted, looked_up = sum(drafts), sum(ks) - sum(drafts)
        overhead = self.overhead_s + self.lookup_token_overhead_s * looked_up
        if drafted:
            overhead += self.draft_round_overhead_s + self.draft_token_overhead_s * drafted
        return overhead + self.verify_seconds(ks, steps) + self.draft_seconds(drafts, feeds, saved, widened)

    def verify_seconds(self, ks: Sequence[int], steps: Sequence[int] | None = None) -> float:
        """The target's one forward over K+1 tokens per request, every request as wide as the
        widest (the engine pads a batch's chunks to the longest: a narrower request saves none
        of the forward); in a multi-step plain round (every K is 0, request i decodes steps[i]
        tokens), step j runs over the requests with steps >= j."""
        widest = max(ks, default=0)
        if steps is None or widest > 0 or max(steps, default=1) <= 1:
            return self.target.seconds(len(ks), 1 + widest)
        return _one_token_steps(self.target, steps, first=1)

    def draft_seconds(
        self, ks: Sequence[int], feeds: Sequence[int] | None = None, saved: Sequence[float] | None = None,
        widened: Sequence[float] | None = None,
    ) -> float:
        """The draft's steps: step j runs over the requests with k >= j.

        The first step also feeds what the draft has not seen: feeds[i] tokens for request
        i (default 1). That is 2 after a fully accepted round (the last draft token and the
        bonus token), priced as a 2-token forward: counted as a 1-token step, the online rescale
        spreads its cost over every step (docs/performance.md#two-token-draft-feed).

        With `saved`, feeds include guessed tokens and request i skips saved[i] steps (expected:
        the guessed tokens it draws too). Its first forward is then as wide as the widest feed,
        since a batch's chunks are padded to the longest. `widened[i]` guessed tokens of the
        draft's own widen request i's forwards, one token of width each.
        """
        spec = [i for i, k in enumerate(ks) if k > 0]
        if not spec or self.draft is None:
            return 0.0
        if feeds is None:
            width = 1.0
        elif saved is not None:
            width = max(feeds[i] for i in spec)
        else:
            width = sum(max(1, feeds[i]) for i in spec) / len(spec)
        first = self.draft.seconds(len(spec), width)
        lengths = [ks[i] - (saved[i] if saved is not None else 0.0) for i in spec]
        wider = sum(widened[i] for i in spec) * self.draft.width_seconds() if widened is not None else 0.0
        return first + _one_token_steps(self.draft, lengths, first=2) + wider

    def tokens_per_second(
        self,
        ks: Sequence[int],
        alphas: Sequence[Sequence[float]],
        start_costs: Sequence[float] | None = None,
        feeds: Sequence[int] | None = None,
        steps: Sequence[int] | None = None,
        lookup: Sequence[bool] | None = None,
        saved: Sequence[float] | None = None,
        widened: Sequence[float] | None = None,
    ) -> float:
        """Expected emitted tokens per second of a round with draft lengths `ks`.

        `start_costs[i]` is a one-off cost request i pays this round if the draft model drafts
        for it (the draft catching up on tokens it has not seen), already spread over the rounds
        it pays for; `feeds`, `saved` and `widened` as in `draft_seconds`; `steps` as in `verify_seconds`
        (a plain round only); `lookup` as in `round_seconds`. `alphas[i]` is the acceptance of
        request i's source.
        """
        if steps is not None and not sum(ks):
            return sum(steps) / self.round_seconds(ks, steps=steps)
        emitted = sum(expected_tokens(a, k) for a, k in zip(alphas, ks))
        drafts = model_ks(ks, lookup)
        extra = sum(c for c, k in zip(start_costs, drafts) if k > 0) if start_costs is not None else 0.0
        return emitted / (self.round_seconds(ks, feeds, lookup=lookup, saved=saved, widened=widened) + extra)


def model_ks(ks: Sequence[int], lookup: Sequence[bool] | None) -> list[int]:
    """The draft model's share of `ks`: 0 where a lookup proposed the tokens."""
    return list(ks) if lookup is None else [0 if looked_up else k for k, looked_up in zip(ks, lookup)]
