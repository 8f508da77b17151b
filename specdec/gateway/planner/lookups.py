"""Lookup proposals in the planner: their acceptance, and which of their tokens pay.

A lookup proposal (`specdec.gateway.proposers`) costs the round only its verified tokens. α of a
lookup is kept per source and match length (`match_class`), over all requests. Token j of a
lookup is judged only if the j before it were accepted, and then its match is j tokens longer:
so its α is the estimate of that longer match, and a proposal grows more certain as it goes.
Each request scales those α by how its own lookups have fared against them (`LookupTrust`), so
a text that does not copy stops paying for lookups learnt on one that does. A lookup passed over
still teaches its kind's α (`judge_offered`), and may guide the model draft as its guess.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.cost_model import RoundCostModel
from specdec.gateway.draft_sources import DraftSource
from specdec.gateway.planner.estimates import AcceptanceEstimate, LookupTrust
from specdec.gateway.planner.rates import RatePredictor, SourceChoice, lookup_length
from specdec.gateway.proposers import LookupDraft, match_class
from specdec.gateway.request import Request
from specdec.gateway.rounds import RoundPlan

#: The most a request's trust may raise a lookup's α: a sure copy can still part.
MAX_LOOKUP_ALPHA = 0.99


@dataclass
class LookupEstimates:
    #: Prior acceptance of a lookup of each source and match length, and the EMA weight of its
    #: estimate (shared by all requests, so it learns fast).
    prior_alpha: float = 0.5
    weight: float = 0.02
    _estimates: dict[tuple[DraftSource, int], AcceptanceEstimate] = field(default_factory=dict)
    _trust: dict[str, LookupTrust] = field(default_factory=dict)

    def estimate(self, lookup: LookupDraft, offset: int = 0) -> AcceptanceEstimate:
        """α of the token `offset` places into lookups like this one: same source, and a match
        `offset` tokens longer than theirs (the tokens before it accepted, it is)."""
        key = (lookup.source, match_class(lookup.match_len + offset))
        estimate = self._estimates.get(key)
        if estimate is None:
            estimate = self._estimates[key] = AcceptanceEstimate(self.prior_alpha, self.weight)
        return estimate

    def alphas(self, lookup: LookupDraft, trust: float = 1.0) -> list[float]:
        """α of each of the lookup's tokens given the ones before it were accepted, scaled by the
        request's `trust`; the last entry stands for the rest (as `expected_tokens` reads it), so
        equal trailing ones go."""
        alphas = [min(MAX_LOOKUP_ALPHA, trust * self.estimate(lookup, j).alpha) for j in range(max(1,
                                                                                                   len(lookup.tokens)))]
        while len(alphas) > 1 and alphas[-1] == alphas[-2]:
            alphas.pop()
        return alphas

    def request_alphas(self, seqs: list[Request], lookups: dict[str, LookupDraft]) -> list[list[float]]:
        """α of each request's lookup proposal ([0.0] where it has none)."""
        return [self.alphas(lookups[s.slot_id], self.trust(s)) if s.slot_id in lookups else [0.0] for s in seqs]

    def all(self) -> list[tuple[tuple[DraftSource, int], AcceptanceEstimate]]:
        """Every estimate by (source, `match_class`), shortest matches first."""
        return sorted(self._estimates.items(), key=lambda item: (item[0][0].value, item[0][1]))

    def source_alpha(self, source: DraftSource) -> float:
        """α of the source's shortest matches (its prior before any was judged)."""
        kinds = [estimate for (kind, _), estimate in self.all() if kind is source]
        return kinds[0].alpha if kinds else self.prior_alpha

    def observe(self, lookup: LookupDraft, k: int, num_accepted: int, slot_id: str | None = None,
                now: float | None = None) -> None:
        """`k` of the lookup's tokens were verified and the first `num_accepted` kept: each judged
        token teaches the estimate of its own match length, and the trust of request `slot_id`."""
        trust = self._trust.setdefault(slot_id, LookupTrust()) if slot_id is not None else None
        for j in range(min(num_accepted + 1, k)):
            estimate = self.estimate(lookup, j)
            if trust is not None:
                trust.observe(estimate.alpha, j < num_accepted)
            estimate.observe(1, 1 if j < num_accepted else 0, now)

    def trust(self, seq: Request) -> float:
        """How far the request's lookups fare above (> 1) or below their kinds' α (`LookupTrust`)."""
        trust = self._trust.get(seq.slot_id)
        return trust.factor if trust is not None else 1.0

    def judge_offered(self, plan: RoundPlan, seqs: list[Request], now: float) -> None:
        """Learn from the lookups the round did not verify as if it had: each emitted token has
        the target's distribution given the ones before it, so it equals a lookup's token with
        probability p(t), which is exactly the chance that verifying the one-hot draft would keep
        it. A low first estimate cannot keep lookups off for good."""
        for seq in seqs:
            offered = plan.offered.get(seq.slot_id)
            if offered is None:
                continue
            start, lookup = offered
            emitted = seq.tokens[start:]
            matched = lookup.agreeing(emitted)
            judged = matched + 1 if matched < min(len(lookup.tokens), len(emitted)) else matched
            self.observe(lookup, judged, matched, seq.slot_id, now)

    def forget(self, slot_id: str) -> None:
        self._trust.pop(slot_id, None)


def take_lookups(
    rates: RatePredictor, choice: SourceChoice, candidates: list[Request], caps: dict[str, int],
    lookups: dict[str, LookupDraft], best_rate: float,
) -> float:
    """Switch each candidate to its lookup proposal, as many tokens of it as pay
    (`lookup_length`), where that raises the batch's rate; returns the rate."""
    extra_token_s = rates.extra_token_seconds()
    for s in candidates:
        slot = s.slot_id
        limit = min(caps[slot], len(lookups[slot].tokens))
        k = lookup_length(rates.lookup_alphas[rates.seqs.index(s)], limit, extra_token_s * best_rate)
        if k == 0:
            continue
        before, was_lookup = choice.ks[slot], slot in choice.on_lookup
        choice.set(slot, k, lookup=True)
        rate = rates.rate(choice.ks, choice.on_lookup)
        if rate > best_rate:
            best_rate = rate
        else:
            choice.set(slot, before, lookup=was_lookup)
    return best_rate


def guess_cuts(
    model: RoundCostModel, seqs: list[Request], caps: dict[str, int], lookups: dict[str, LookupDraft],
    lookup_alphas: list[list[float]], model_ok: set[str],
) -> list[int]:
    """How many tokens of its lookup each request could give the draft model as a guess: as
    many as pay at batch 1 (`lookup_length`: the j-th saves a draft step with the chance that
    the draft draws the first j too, and widens its first forward by a token). None where the
    draft has more to feed than a round adds (K + 1): a prompt, which feeds no guess after one."""
    if model.draft is None:
        return []
    threshold = model.draft.width_seconds() / model.draft.step(1)  # a fed token ÷ a step
    cuts = []
    for s, alphas in zip(seqs, lookup_alphas):
        lookup = lookups.get(s.slot_id)
        usable = lookup is not None and s.slot_id in model_ok and s.draft_pending <= caps[s.slot_id] + 1
        cuts.append(lookup_length(alphas, len(lookup.tokens), threshold) if usable and lookup else 0)
    return cuts


def best_guesses(rates: RatePredictor, choice: SourceChoice, lookups: dict[str, LookupDraft]) -> dict[str, LookupDraft]:
    """The guesses the model-drafted requests of `choice` give the draft: each request's cut, at
    the one cap over the batch that maximises its rate (a batch's first forward is as wide as
    its longest feed, so one long guess widens every request's)."""
    if not any(rates.guess_cuts):
        return {}
    best_cap, best_rate = None, rates.rate(choice.ks, choice.on_lookup)
    for cap in range(max(rates.guess_cuts)):
        rate = rates.rate(choice.ks, choice.on_lookup, guess_cap=cap)
        if rate > best_rate:
            best_cap, best_rate = cap, rate
    out = {}
    for i, s in enumerate(rates.seqs):
        if s.slot_id not in choice.on_lookup and (n := rates.guess_length(i, choice.ks[s.slot_id], best_cap)):
            out[s.slot_id] = lookups[s.slot_id].truncated(n)
    return out
