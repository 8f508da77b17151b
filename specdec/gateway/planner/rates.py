"""What the planner weighs: a round's choice of K and source per request, and the batch's
predicted tokens per second for any such choice (`specdec.gateway.planner.core` decides)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, replace

from specdec.cost_model import RoundCostModel, expected_tokens
from specdec.gateway.proposers import LookupDraft
from specdec.gateway.request import Request

#: Rounds at most over which a draft catch-up is spread: its payback is an estimate (a
#: request may stop early), and a crowd of fresh requests all catching up at once stalls
#: every stream. Shorter horizons kept short requests from ever drafting
#: (docs/performance.md#adaptive-k-planner-rules).
CATCH_UP_HORIZON = 16.0


@dataclass(frozen=True)
class CatchUp:
    """What feeding the draft the tokens it has not seen costs beyond a normal step
    (`extra_s`), repaid over the `tokens_left` the request may still emit."""

    extra_s: float = 0.0
    tokens_left: int = 0

    def per_round(self, alphas: list[float], k: int) -> float:
        """The catch-up spread over the rounds left at draft length `k` (at most
        CATCH_UP_HORIZON): a long K emits more a round, so fewer rounds share the cost."""
        if self.extra_s <= 0.0 or k <= 0:
            return 0.0
        rounds_left = self.tokens_left / expected_tokens(alphas, k)
        return self.extra_s / min(max(1.0, rounds_left), CATCH_UP_HORIZON)


@dataclass
class SourceChoice:
    """A round's choice so far: K per request, and which requests take theirs from a lookup."""

    ks: dict[str, int]
    on_lookup: set[str] = field(default_factory=set)

    def set(self, slot_id: str, k: int, *, lookup: bool) -> None:
        self.ks[slot_id] = k
        if lookup:
            self.on_lookup.add(slot_id)
        else:
            self.on_lookup.discard(slot_id)


def fixed_choice(
    seqs: list[Request], caps: dict[str, int], lookups: dict[str, LookupDraft], model_ok: set[str]
) -> SourceChoice:
    """What a request whose K is not the planner's to choose gets: its lookup proposal when the
    draft model may not draft for it or the proposal fills its K (then the model has nothing
    to add), else the model draft at its K, else nothing."""
    choice = SourceChoice({})
    for s in seqs:
        slot, cap, lookup = s.slot_id, caps[s.slot_id], lookups.get(s.slot_id)
        if lookup is not None and cap > 0 and (slot not in model_ok or len(lookup.tokens) >= cap):
            choice.set(slot, min(cap, len(lookup.tokens)), lookup=True)
        else:
            choice.set(slot, cap if slot in model_ok else 0, lookup=False)
    return choice


def fixed_guesses(
    seqs: list[Request], choice: SourceChoice, caps: dict[str, int], lookups: dict[str, LookupDraft]
) -> dict[str, LookupDraft]:
    """Without costs to price a guess by: every request the model drafts for gives the draft its
    whole lookup as a guess (at most K - 1 tokens: the K-th is never fed), unless the draft has
    more to feed than a round adds (K + 1 tokens), which it would take for a prompt."""
    out = {}
    for s in seqs:
        slot, k, lookup = s.slot_id, choice.ks[s.slot_id], lookups.get(s.slot_id)
        if lookup is not None and k > 1 and slot not in choice.on_lookup and s.draft_pending <= caps[slot] + 1:
            out[slot] = lookup.truncated(k - 1)
    return out


def lookup_length(alphas: list[float], limit: int, threshold: float) -> int:
    """How many tokens of a lookup proposal pay, at most `limit`: token j, accepted with
    probability `alphas[j]` given the ones before it were (the last entry repeats), adds
    Π α expected tokens to the round and costs one more verified token, so it pays while
    that product exceeds the token's seconds times the batch's tokens per second (`threshold`)."""
    k, survive = 0, 1.0
    while k < limit:
        survive *= alphas[min(k, len(alphas) - 1)]
        if survive <= threshold:
            break
        k += 1
    return k


@dataclass(frozen=True)
class SelfGuessRates:
    """Per step after a model round's first forward, where the draft guesses with its own
    lookup: the share of steps the guesses save, and the guessed tokens fed (width)."""

    saved: float = 0.0
    fed: float = 0.0


@dataclass(frozen=True)
class RatePredictor:
    """Tokens per second of one batch for any Ks and sources, from the cost model, each
    request's α of the model draft and of its lookup proposal, its catch-up and round feed."""

    model: RoundCostModel
    seqs: list[Request]
    alphas: list[list[float]]
    catch_ups: list[CatchUp]
    feeds: list[int]
    #: α of each request's lookup proposal ([0.0] where it has none).
    lookup_alphas: list[list[float]] = field(default_factory=list)
    #: The most tokens of its lookup each request may give the draft model as a guess (0: none).
    guess_cuts: list[int] = field(default_factory=list)
    #: What the guesses are expected to do in each request's model round where its draft
    #: guesses on its own (all zero where it does not).
    self_guesses: list[SelfGuessRates] = field(default_factory=list)

    def rate(self, ks: dict[str, int], on_lookup: Collection[str] = frozenset(),
             plain_steps: list[int] | None = None, guess_cap: int | None = None) -> float:
        """The batch's expected tokens per second with K `ks` per slot, the slots in
        `on_lookup` verifying a lookup's tokens, the others guessing as `guess_length` says."""
        k_list = [ks[s.slot_id] for s in self.seqs]
        lookup = [s.slot_id in on_lookup for s in self.seqs]
        alphas = [own if looked_up else a for a, own, looked_up in zip(self.alphas, self.lookup_alphas, lookup)]
        start = [c.per_round(a, k) for c, a, k in zip(self.catch_ups, self.alphas, k_list)]
        guesses = [0 if looked_up else self.guess_length(i, k, guess_cap)
                   for i, (k, looked_up) in enumerate(zip(k_list, lookup))]
        # Each guessed token widens the draft's first forward; the j-th saves a step if the
        # draft draws the first j too, which the lookup's α prices.
        feeds = [feed + guess for feed, guess in zip(self.feeds, guesses)]
        saved = [expected_tokens(a, guess) - 1.0 if guess else 0.0 for a, guess in zip(self.lookup_alphas, guesses)]
        widened = None
        if self.self_guesses:  # a draft guessing on its own saves and widens its usual share of the later steps
            saved = [s if looked_up else max(s, g.saved * (k - 1))
                     for s, g, k, looked_up in zip(saved, self.self_guesses, k_list, lookup)]
            widened = [0.0 if looked_up else g.fed * max(0, k - 1)
                       for g, k, looked_up in zip(self.self_guesses, k_list, lookup)]
        return self.model.tokens_per_second(k_list, alphas, start, feeds, plain_steps,
                                            lookup if any(lookup) else None, saved if any(saved) else None,
                                            widened if widened and any(widened) else None)

    def guess_length(self, i: int, k: int, cap: int | None = None) -> int:
        """Guessed tokens request i feeds the draft model at draft length `k`: its cut, at most
        `cap`, and never the K-th (the draft does not feed its last token)."""
        if not self.guess_cuts:
            return 0
        cut = self.guess_cuts[i] if cap is None else min(self.guess_cuts[i], cap)
        return max(0, min(cut, k - 1))

    def extra_token_seconds(self) -> float:
        """What one more verified token of one request adds to the round: the verify's cost per
        token of width at this batch size, shared by its requests, and the per-token overhead."""
        batch = len(self.seqs)
        target = self.model.target
        return (target.seconds(batch, 2) - target.seconds(batch, 1)) / batch + self.model.lookup_token_overhead_s

    def probe_could_pay(self, seq: Request, ks: dict[str, int], caps: dict[str, int],
                        on_lookup: Collection[str] = frozenset()) -> bool:
        """Whether the model drafting for `seq` would raise the batch's rate if its draft were
        always accepted. If not, the batch's size or the draft's cost keeps it off, not its
        acceptance, and a probe could not change the decision."""
        i = self.seqs.index(seq)
        hopeful = replace(self, alphas=[*self.alphas[:i], [1.0], *self.alphas[i + 1:]])
        trial = dict(ks)
        current = hopeful.rate(trial, on_lookup)
        for k in range(1, caps[seq.slot_id] + 1):
            trial[seq.slot_id] = k
            if hopeful.rate(trial, on_lookup) > current:
                return True
        return False
