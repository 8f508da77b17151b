"""Choose K (draft tokens per request) for every round from measured costs and acceptance.

Each round the planner predicts with `specdec.cost_model` the batch's tokens per second for
every uniform K up to the largest allowed, keeps the best, and turns speculation off for a
request whose own drafting lowers the batch's rate. K = 0 everywhere is plain decoding, so
speculation switches itself off when it does not pay. Its inputs are the services' forward
costs (rescaled online by the compute they report), the round overhead outside them, and α
per request. A request kept at K = 0 is re-probed with a small K now and then, where a probe
is affordable and could change the decision. The rules and their reasons:
docs/architecture.md#adaptive-k.

The planner also picks each request's draft source: a lookup proposal (`specdec.gateway.proposers`)
costs the round only its verified tokens, the model draft its draft steps and Propose too. After
the uniform K of the model draft, each request with a lookup proposal switches to it where
that raises the batch's rate, with as many of its tokens as pay (`lookup_length`); α of a
lookup is kept per source and match length (`match_class`), over all requests. Token j of a
lookup is judged only if the j before it were accepted, and then its match is j tokens
longer: so its α is the estimate of that longer match, and a proposal grows more certain
as it goes. Each request scales those α by how its own lookups have fared against them
(`LookupTrust`), so a text that does not copy stops paying for lookups learnt on one that does.
A request that may look up drafts by lookup or plainly before it pays for a long prompt's draft
catch-up (`KPlanner._renting`): its first rounds show whether its answer copies or ends soon.
Where the target's cache can fill the draft's (`kv_handoff`), a catch-up is that copy where it
is the cheaper of the two as measured (`KPlanner._hands_off`), and renting rarely applies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace

from specdec.cost_model import CostTable, ForwardCost, RoundCostModel
from specdec.gateway.draft_sources import DraftSource
from specdec.gateway.kv_handoff import HandoffCost, KVHandoff
from specdec.gateway.proposers import LookupDraft, match_class
from specdec.gateway.round_rates import (
    CatchUp,
    RatePredictor,
    SelfGuessRates,
    SourceChoice,
    fixed_choice,
    fixed_guesses,
    lookup_length,
)
from specdec.gateway.rounds import RoundPlan, RoundReport
from specdec.gateway.sequence import Sequence

__all__ = ["OFF_REASONS", "AcceptanceEstimate", "DraftOverhead", "KPlanner", "LookupTrust", "RatePredictor"]
log = logging.getLogger(__name__)

#: The most tokens a round leaves for the draft to feed: the last draft token and the bonus
#: token after a fully accepted round. More (a prompt, tokens decoded while speculation
#: was off) is a catch-up, priced by `KPlanner._catch_up`.
MAX_ROUND_FEED = 2
#: Why a round speculated less than it could, as exported in the metrics.
OFF_REASONS = ("not_paying", "batch", "draft_unavailable")


@dataclass
class AcceptanceEstimate:
    """α, the chance that a draft token is accepted given the ones before it were: an
    exponential moving average over every judged draft token, all positions pooled.

    A round that accepted n of K tokens judged n + 1 of them (n accepted, one rejected) or
    K (all accepted); the rest were never judged and teach nothing. The model of a round is
    then geometric in α (`expected_tokens` with one α).

    Pooled, not per position: an estimate per position sees one outcome per round, so a
    single rejection at a late position shortens K, and positions past the new K are never
    judged again to repair it.

    The starting value counts as one outcome plus those `seen` before it (a request starts
    from the batch-wide estimate and what it has seen): outcome n has weight
    max(`weight`, 1 / (seen + n + 1)), so the first outcomes are averaged, not nudged.
    """

    alpha: float
    weight: float
    #: Outcomes the starting value stands for, beyond the prior's one; grows as outcomes come.
    seen: int = 0

    @property
    def alphas(self) -> list[float]:
        """α for position 1, which every later position reuses (see `expected_tokens`)."""
        return [self.alpha]

    def observe(self, k: int, num_accepted: int) -> None:
        """A round drafted k tokens and the first `num_accepted` were accepted."""
        for j in range(min(num_accepted + 1, k)):
            self.seen += 1
            outcome = 1.0 if j < num_accepted else 0.0
            self.alpha += max(self.weight, 1.0 / (self.seen + 1)) * (outcome - self.alpha)

    def fork(self, weight: float) -> AcceptanceEstimate:
        """A copy that goes on learning at `weight` (a request's own estimate)."""
        return AcceptanceEstimate(self.alpha, weight, self.seen)


@dataclass
class DraftOverhead:
    """What drafting adds to a round's overhead: ``per_round + per_token * Σk``, fit online
    by exponentially weighted least squares over the rounds that drafted.

    Until those rounds drafted different totals Σk the split is unknown, and all of it is
    put on the tokens. Charging a fixed Propose cost per token would make long K look too
    dear.
    """

    weight: float
    per_round: float = 0.0
    per_token: float = 0.0
    #: Weighted means of Σk, the excess overhead, Σk² and Σk × excess (empty before any round).
    _means: list[float] = field(default_factory=list)

    def observe(self, drafted: int, excess_s: float) -> None:
        """A round drafted `drafted` tokens in all and its overhead exceeded a plain round's by `excess_s`."""
        sample = [float(drafted), excess_s, float(drafted * drafted), drafted * excess_s]
        if not self._means:
            self._means = sample
        else:
            self._means = [m + self.weight * (x - m) for m, x in zip(self._means, sample)]
        mean_k, mean_y, mean_kk, mean_ky = self._means
        variance = mean_kk - mean_k * mean_k
        slope = (mean_ky - mean_k * mean_y) / variance if variance > 0.25 else -1.0
        if 0.0 <= slope <= mean_y / mean_k:
            self.per_token, self.per_round = slope, mean_y - slope * mean_k
        else:  # no spread in Σk yet, or a fit outside [all per round, all per token]
            self.per_token, self.per_round = max(mean_y, 0.0) / mean_k, 0.0


@dataclass
class _Mean:
    """EMA of a measured quantity. Its first observations are averaged, not nudged (weight
    max(`weight`, 1 / n) for the n-th), so a poor starting value is gone within a few."""

    value: float = 0.0
    seen: int = 0

    def observe(self, x: float, weight: float) -> None:
        self.seen += 1
        self.value += max(weight, 1.0 / self.seen) * (x - self.value)


@dataclass
class _Scale(_Mean):
    """Measured ÷ predicted seconds for one service, averaged as `_Mean`: a cost table timed on
    a busy machine is corrected within the first rounds that use it."""

    value: float = 1.0

    def observe_ratio(self, measured: float, predicted: float, weight: float) -> None:
        if measured > 0 and predicted > 0:
            self.observe(measured / predicted, weight)


@dataclass
class SelfGuessEstimate:
    """What guesses did in a request's model rounds whose draft guesses on its own, per step
    after the first forward: the share of steps they saved, and the tokens of the draft's own
    guesses fed (each a token of width)."""

    saved: _Mean = field(default_factory=_Mean)
    fed: _Mean = field(default_factory=_Mean)

    def observe(self, k: int, saved: int, fed: int, weight: float) -> None:
        self.saved.observe(saved / (k - 1), weight)
        self.fed.observe(fed / (k - 1), weight)

    @property
    def rates(self) -> SelfGuessRates:
        return SelfGuessRates(self.saved.value, self.fed.value)


@dataclass
class LookupTrust:
    """How one request's lookups fare against the α of their kinds: the tokens they kept over
    the tokens those α expected, over every judged token (verified or offered), starting from
    `prior` tokens that fared as expected. `factor` scales the request's lookup α, so a text
    whose lookups miss where other texts' lookups of the same kind hit stops trusting them
    after a round or two, and one whose lookups hit more trusts them more."""

    prior: float = 2.0
    kept: float = 0.0
    expected: float = 0.0

    @property
    def factor(self) -> float:
        return (self.kept + self.prior) / (self.expected + self.prior)

    def observe(self, alpha: float, kept: bool) -> None:
        self.expected += alpha
        self.kept += kept


def catch_up_class(tokens: int) -> int:
    """The length class of a catch-up of `tokens` tokens: their count's power of two."""
    return max(tokens, 1).bit_length()


#: A draft catch-up dearer than this many plain rounds waits until waiting has cost its
#: request as much (`KPlanner._renting`). Waiting costs only the saving it forgoes, so it lasts
#: several times the catch-up's rounds: a chat prompt's catch-up of a few rounds is cheaper bought.
RENT_FROM_ROUNDS = 8
#: The most a request's trust may raise a lookup's α: a sure copy can still part.
MAX_LOOKUP_ALPHA = 0.99
#: A plain round's overhead at most this share of a target step counts as cheap
#: (`KPlanner.calls_are_cheap`): on CPU it is a few percent and a lookup request's one-step
#: plain rounds paid; on a GPU a call can cost a fifth of a step, which multi-step rounds save.
CHEAP_CALL_SHARE = 0.1


@dataclass
class KPlanner:
    """Plans K per request and round; see the module docstring."""

    target_costs: Seq[ForwardCost]
    draft_costs: Seq[ForwardCost]
    #: Prior acceptance before any draft token was judged.
    prior_alpha: float = 0.8
    #: EMA weights: per judged draft token for a request's own acceptance and the
    #: batch-wide one new requests start from; per round for costs and overhead.
    #: Acceptance is nearly memoryless (rounds of K tokens yield close to the geometric
    #: 1 + α + … + α^K), so a rejection says little about the next round: slow weights
    #: (docs/performance.md#adaptive-k-planner-rules).
    request_weight: float = 0.02
    global_weight: float = 0.01
    cost_weight: float = 0.1
    #: A request kept at K = 0 by choice drafts `probe_k` tokens every `probe_every` rounds.
    probe_every: int = 16
    max_probe_every: int = 256
    #: A probe may cost at most this share of the request's remaining plain-decoding time.
    probe_budget: float = 0.05
    probe_k: int = 2
    overhead_s: float = 0.0
    #: Prior acceptance of a lookup of each source and match length, and the EMA weight of
    #: its estimate (shared by all requests, so it learns fast).
    lookup_prior_alpha: float = 0.5
    lookup_weight: float = 0.02
    #: Whether this gateway has a draft model: without one, adapting needs the target's costs only.
    uses_draft: bool = True
    #: Whether the draft model may get a request's lookup as a guess (`RoundPlan.guesses`).
    guesses: bool = True
    #: Seconds each verified lookup token adds to a round's overhead (wire, acceptance), online.
    lookup_token_overhead_s: float = 0.0
    #: How the target's cache fills the draft's where the draft falls behind (None: the draft
    #: catches up by itself), and what a handoff costs, online.
    kv_handoff: KVHandoff | None = None
    handoff_cost: HandoffCost = field(default_factory=HandoffCost)
    global_alpha: AcceptanceEstimate = field(init=False)
    _target: CostTable | None = field(init=False)
    _draft: CostTable | None = field(init=False)
    draft_overhead: DraftOverhead = field(init=False)
    _target_scale: _Scale = field(default_factory=_Scale, init=False)
    _draft_scale: _Scale = field(default_factory=_Scale, init=False)
    #: Measured ÷ predicted seconds of the draft's catch-ups past its table's widest chunk, per
    #: `catch_up_class` of their length.
    _catch_up_scales: dict[int, _Scale] = field(default_factory=dict, init=False)
    _estimates: dict[str, AcceptanceEstimate] = field(default_factory=dict, init=False)
    _idle_rounds: dict[str, int] = field(default_factory=dict, init=False)
    _probe_interval: dict[str, int] = field(default_factory=dict, init=False)
    _probing: set[str] = field(default_factory=set, init=False)
    _lookup_estimates: dict[tuple[DraftSource, int], AcceptanceEstimate] = field(default_factory=dict, init=False)
    #: How each request's lookups fared against their kinds' α, which scales them for it.
    _lookup_trust: dict[str, LookupTrust] = field(default_factory=dict, init=False)
    #: What guesses do in the model rounds of each request that lets the draft guess with its own
    #: lookup (`RoundPlan.self_guessing`), and over all of them (a new request's first estimate).
    _self_guesses: dict[str, SelfGuessEstimate] = field(default_factory=dict, init=False)
    _global_self_guesses: SelfGuessEstimate = field(default_factory=SelfGuessEstimate, init=False)
    #: Whether any round with draft tokens has been observed (α is more than the prior).
    _measured_alpha: bool = field(default=False, init=False)
    #: Seconds of the rounds each request spent waiting to pay its draft's catch-up (`_renting`).
    _rent: dict[str, float] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.global_alpha = AcceptanceEstimate(self.prior_alpha, self.global_weight)
        self.draft_overhead = DraftOverhead(self.cost_weight)
        self._target = CostTable(self.target_costs) if self.target_costs else None
        self._draft = CostTable(self.draft_costs) if self.draft_costs else None

    def set_costs(self, service: str, costs: Seq[ForwardCost]) -> None:
        """A service restarted with other start-up costs ("target" or "draft"): plan with them,
        and measure its online correction afresh."""
        table = CostTable(costs) if costs else None
        if service == "target":
            self._target, self._target_scale = table, _Scale()
        else:
            self._draft, self._draft_scale, self._catch_up_scales = table, _Scale(), {}

    @property
    def can_adapt(self) -> bool:
        """The services advertised their costs (they measure them at start-up by default): the
        target's, and the draft's where there is a draft model."""
        return self._target is not None and (self._draft is not None or not self.uses_draft)

    def calls_are_cheap(self, batch_size: int) -> bool:
        """Whether a plain round's measured overhead (the call, acceptance) is at most
        `CHEAP_CALL_SHARE` of a target step for `batch_size` requests: then a multi-step plain
        round saves little, and a request that drafts by lookup gains more from a lookup after
        every token (docs/performance.md#plain-rounds-of-requests-that-look-up)."""
        if self._target is None:
            return False
        step = self._target.step(batch_size) * self._target_scale.value
        return self.overhead_s <= CHEAP_CALL_SHARE * step

    def cost_model(self, context: float | None = None) -> RoundCostModel:
        """The round cost model with the online scales, pricing requests that hold `context`
        cached tokens on average (default: the context the services measured at)."""
        if self._target is None:
            raise RuntimeError("no target cost table: the target did not measure its costs")
        target, draft = self._at_context(context)
        return RoundCostModel(
            target=target.scaled(self._target_scale.value),
            draft=draft.scaled(self._draft_scale.value) if draft else None,
            overhead_s=self.overhead_s,
            draft_round_overhead_s=self.draft_overhead.per_round,
            draft_token_overhead_s=self.draft_overhead.per_token,
            lookup_token_overhead_s=self.lookup_token_overhead_s,
        )

    def _at_context(self, context: float | None) -> tuple[CostTable, CostTable | None]:
        """Both unscaled tables at `context` (as measured when None)."""
        assert self._target is not None
        if context is None:
            return self._target, self._draft
        return self._target.at_context(context), self._draft.at_context(context) if self._draft else None

    def alphas(self, seq: Sequence) -> list[float]:
        estimate = self._estimates.get(seq.slot_id)
        return estimate.alphas if estimate is not None else self.global_alpha.alphas

    def lookup_estimate(self, lookup: LookupDraft, offset: int = 0) -> AcceptanceEstimate:
        """α of the token `offset` places into lookups like this one: same source, and a match
        `offset` tokens longer than theirs (the tokens before it accepted, it is), by `match_class`."""
        key = (lookup.source, match_class(lookup.match_len + offset))
        estimate = self._lookup_estimates.get(key)
        if estimate is None:
            estimate = self._lookup_estimates[key] = AcceptanceEstimate(self.lookup_prior_alpha, self.lookup_weight)
        return estimate

    def lookup_alphas(self, lookup: LookupDraft, trust: float = 1.0) -> list[float]:
        """α of each of the lookup's tokens given the ones before it were accepted, scaled by the
        request's `trust` (`LookupTrust.factor`); the last entry stands for the rest (as
        `expected_tokens` reads it), so equal trailing ones go."""
        alphas = [min(MAX_LOOKUP_ALPHA, trust * self.lookup_estimate(lookup, j).alpha)
                  for j in range(max(1, len(lookup.tokens)))]
        while len(alphas) > 1 and alphas[-1] == alphas[-2]:
            alphas.pop()
        return alphas

    def lookup_estimates(self) -> list[tuple[tuple[DraftSource, int], AcceptanceEstimate]]:
        """Every lookup acceptance estimate by (source, `match_class`), shortest matches first."""
        return sorted(self._lookup_estimates.items(), key=lambda item: (item[0][0].value, item[0][1]))

    def observe_lookup(self, lookup: LookupDraft, k: int, num_accepted: int, slot_id: str | None = None) -> None:
        """`k` of the lookup's tokens were verified and the first `num_accepted` kept: each judged
        token teaches the estimate of its own match length, and the trust of request `slot_id`."""
        trust = self._lookup_trust.setdefault(slot_id, LookupTrust()) if slot_id is not None else None
        for j in range(min(num_accepted + 1, k)):
            estimate = self.lookup_estimate(lookup, j)
            if trust is not None:
                trust.observe(estimate.alpha, j < num_accepted)
            estimate.observe(1, 1 if j < num_accepted else 0)

    def lookup_trust(self, seq: Sequence) -> float:
        """How far the request's lookups fare above (> 1) or below their kinds' α (`LookupTrust`)."""
        trust = self._lookup_trust.get(seq.slot_id)
        return trust.factor if trust is not None else 1.0

    def plan(
        self, seqs: list[Sequence], caps: dict[str, int], adaptive: dict[str, bool],
        steps: dict[str, int] | None = None, *, lookups: dict[str, LookupDraft] | None = None,
        model_allowed: Collection[str] | None = None, lookup_allowed: Collection[str] = (),
        self_guessing: Collection[str] = (),
    ) -> RoundPlan:
        """K and draft source per request. `caps` bounds each K (its requested or remaining room);
        `lookups` are this round's lookup proposals (of the `lookup_allowed` requests that have
        one), `model_allowed` the requests the draft model may draft for (default: all), and
        `self_guessing` those whose draft may guess with its own lookup (with `guesses`). Adaptive
        requests get the planner's choice, the others `fixed_choice`. `steps` is what a plain
        round would decode per request (multi-step), which prices K = 0; the plan keeps them
        when no request drafts."""
        steps, lookups = steps or {}, lookups or {}
        model_ok = {s.slot_id for s in seqs} if model_allowed is None else set(model_allowed)
        feeds = {s.slot_id: self._feed(s) for s in seqs}
        context = sum(len(s.tokens) for s in seqs) / len(seqs) if seqs else None
        choice = fixed_choice(seqs, caps, lookups, model_ok)
        flexible = [s for s in seqs if adaptive[s.slot_id] and caps[s.slot_id] > 0
                    and (s.slot_id in model_ok or s.slot_id in lookups)]
        guessable = lookups if self.guesses else {}
        own = set(self_guessing) if self.guesses else set()
        off_reason, caught_up_rates = None, {}
        if flexible and self.can_adapt:
            model = self.cost_model(context)
            plain_round = model.round_seconds([0] * len(seqs))
            catch_ups = [self._catch_up(s, model) for s in seqs]
            waiting = self._renting([(s, catch_up) for s, catch_up in zip(seqs, catch_ups)
                                     if s in flexible and s.slot_id in lookup_allowed], plain_round)
            model_ok -= waiting
            alphas, lookup_alphas = [self.alphas(s) for s in seqs], self._lookup_alphas(seqs, lookups)
            rates = RatePredictor(model, seqs, alphas, catch_ups, [feeds[s.slot_id] for s in seqs], lookup_alphas,
                                  self._guess_cuts(model, seqs, caps, guessable, lookup_alphas, model_ok),
                                  [self.self_guess_rates(s) if s.slot_id in own else SelfGuessRates() for s in seqs])
            off_reason = self._choose(rates, choice, flexible, caps, steps, lookups, model_ok)
            caught_up_rates = self._caught_up_rates(waiting, rates, choice, caps, steps)
            guesses = self._guesses(rates, choice, lookups)

            def worth_probing(s: Sequence) -> bool:
                return (self._probe_affordable(s, model, plain_round, len(seqs))
                        and rates.probe_could_pay(s, choice.ks, caps, choice.on_lookup))

            self._schedule_probe([s for s in flexible if s.slot_id in model_ok], choice.ks, caps, worth_probing)
        else:
            guesses = fixed_guesses(seqs, choice, caps, guessable)
        ks = choice.ks
        chosen = {slot: lookups[slot].truncated(ks[slot]) for slot in choice.on_lookup if ks[slot] > 0}
        behind = [s for s in seqs if ks[s.slot_id] > 0 and s.slot_id not in chosen and s.draft_pending > MAX_ROUND_FEED]
        handoffs = frozenset(s.slot_id for s in behind if self._hands_off(s))
        catching = [s for s in behind if s.slot_id not in handoffs]
        offered = {s.slot_id: (len(s.tokens), lookups[s.slot_id]) for s in seqs
                   if s.slot_id in lookups and s.slot_id not in chosen}
        guesses = {slot: guess for slot, guess in guesses.items() if ks[slot] > 0 and slot not in chosen}
        own = {slot for slot in own if ks.get(slot, 0) > 0 and slot not in chosen}
        within, beyond = 0.0, 0.0
        if catching and self._draft is not None:
            for s in catching:
                part_within, part_beyond = self._catch_up_forward(s, self._draft)
                within, beyond = within + part_within, beyond + part_beyond
        longest = max((s.draft_pending for s in catching), default=0)
        return RoundPlan(ks, {} if any(ks.values()) else steps, feeds, context, bool(catching), off_reason, chosen,
                         offered, guesses, own, within + beyond, beyond, longest, caught_up_rates, handoffs)

    def self_guess_rates(self, seq: Sequence) -> SelfGuessRates:
        """What guesses are expected to do in the request's model rounds while its draft guesses
        on its own: its own estimate, else the one over all requests."""
        return self._self_guesses.get(seq.slot_id, self._global_self_guesses).rates

    def _lookup_alphas(self, seqs: list[Sequence], lookups: dict[str, LookupDraft]) -> list[list[float]]:
        """α of each request's lookup proposal ([0.0] where it has none)."""
        return [self.lookup_alphas(lookups[s.slot_id], self.lookup_trust(s)) if s.slot_id in lookups else [0.0]
                for s in seqs]

    @staticmethod
    def _guess_cuts(
        model: RoundCostModel, seqs: list[Sequence], caps: dict[str, int], lookups: dict[str, LookupDraft],
        lookup_alphas: list[list[float]], model_ok: set[str],
    ) -> list[int]:
        """How many tokens of its lookup each request could give the draft model as a guess: as
        many as pay at batch 1 (`lookup_length`: the j-th saves a draft step with the chance
        that the draft draws the first j too, and widens its first forward by a token). None
        where the draft has more to feed than a round adds (K + 1): that is a prompt to the
        draft, which feeds no guess after one."""
        if model.draft is None:
            return []
        threshold = model.draft.width_seconds() / model.draft.step(1)  # a fed token ÷ a step
        cuts = []
        for s, alphas in zip(seqs, lookup_alphas):
            lookup = lookups.get(s.slot_id)
            usable = lookup is not None and s.slot_id in model_ok and s.draft_pending <= caps[s.slot_id] + 1
            cuts.append(lookup_length(alphas, len(lookup.tokens), threshold) if usable and lookup else 0)
        return cuts

    @staticmethod
    def _guesses(rates: RatePredictor, choice: SourceChoice, lookups: dict[str, LookupDraft]) -> dict[str, LookupDraft]:
        """The guesses the model-drafted requests of `choice` give the draft: each request's cut,
        at the one cap over the batch that maximises its rate (a batch's first forward is as
        wide as its longest feed, so one long guess widens every request's)."""
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

    def _choose(
        self, rates: RatePredictor, choice: SourceChoice, flexible: list[Sequence], caps: dict[str, int],
        steps: dict[str, int], lookups: dict[str, LookupDraft], model_ok: set[str],
    ) -> str | None:
        """For the flexible requests: the best uniform K of the model draft (each capped), then
        a lookup instead wherever that raises the batch's rate, then K = 0 for any request whose
        own drafting costs the batch more than it yields. Returns why some went off, if any did."""
        for s in flexible:
            choice.set(s.slot_id, 0, lookup=False)
        plain_steps = [steps.get(s.slot_id, 1) for s in rates.seqs] if steps else None
        best_rate = self._best_model_k(rates, choice, [s for s in flexible if s.slot_id in model_ok], caps, plain_steps)
        best_rate = self._take_lookups(rates, choice, [s for s in flexible if s.slot_id in lookups], caps, lookups,
                                       best_rate)
        if all(choice.ks[s.slot_id] == 0 for s in flexible):
            return "not_paying" if len(rates.seqs) == 1 else "batch"
        off_reason = None
        for s in flexible:
            k, on_lookup = choice.ks[s.slot_id], s.slot_id in choice.on_lookup
            if k == 0:
                continue
            choice.set(s.slot_id, 0, lookup=False)
            rate = rates.rate(choice.ks, choice.on_lookup, plain_steps)
            if rate > best_rate:
                best_rate, off_reason = rate, "not_paying"
            else:
                choice.set(s.slot_id, k, lookup=on_lookup)
        return off_reason

    def _best_model_k(
        self, rates: RatePredictor, choice: SourceChoice, drafting: list[Sequence], caps: dict[str, int],
        plain_steps: list[int] | None,
    ) -> float:
        """Set the uniform K (each capped) of the model draft that maximises the batch's rate
        for the `drafting` requests; returns that rate."""
        best_rate, best_k = -1.0, 0
        for k in range(max((caps[s.slot_id] for s in drafting), default=0) + 1):
            for s in drafting:
                choice.ks[s.slot_id] = min(k, caps[s.slot_id])
            rate = rates.rate(choice.ks, choice.on_lookup, plain_steps)
            if rate > best_rate:
                best_rate, best_k = rate, k
        for s in drafting:
            choice.ks[s.slot_id] = min(best_k, caps[s.slot_id])
        if log.isEnabledFor(logging.DEBUG):
            log.debug("plan: batch %d, best uniform K %d at %.1f tok/s (plain %.1f), α_1 %s, scales t %.2f d %.2f, "
                      "overhead %.1f ms, drafting + %.1f ms + %.1f ms per token", len(rates.seqs), best_k, best_rate,
                      rates.rate(dict.fromkeys(choice.ks, 0), frozenset(), plain_steps),
                      [round(a[0], 2) for a in rates.alphas], self._target_scale.value, self._draft_scale.value,
                      1e3 * self.overhead_s, 1e3 * self.draft_overhead.per_round, 1e3 * self.draft_overhead.per_token)
        return best_rate

    @staticmethod
    def _take_lookups(
        rates: RatePredictor, choice: SourceChoice, candidates: list[Sequence], caps: dict[str, int],
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

    @staticmethod
    def _feed(seq: Sequence) -> int:
        """Tokens the draft's first step takes for `seq`: the 1-2 it has not seen after a
        round, or 1 when it must catch up on more (`_catch_up` prices the rest)."""
        pending = seq.draft_pending
        return pending if 1 <= pending <= MAX_ROUND_FEED else 1

    def _catch_up(self, seq: Sequence, model: RoundCostModel) -> CatchUp:
        """What feeding the draft the tokens it has not seen costs beyond a normal step: a
        prompt the draft never saw (or everything since speculation went off) is a one-off
        prefill that only a long enough future of speculating repays, so the rate prediction
        spreads it over the rounds left at the K it prices (`CatchUp.per_round`). Without this
        a batch of new requests would all start drafting at once and pay seconds of draft
        prefill for a few rounds of gain."""
        if model.draft is None or seq.draft_pending <= MAX_ROUND_FEED:
            return CatchUp()
        extra = self._catch_up_seconds(seq) - model.draft.step(1)
        return CatchUp(max(0.0, extra), seq.max_new_tokens - seq.completion_tokens)

    def _catch_up_seconds(self, seq: Sequence) -> float:
        """Feeding the draft what it has not seen of `seq`: the cheaper of its own forward
        (`_computed_catch_up_seconds`) and, where the target's cache can fill the draft's, a
        handoff of all but the newest token and a step that feeds that one."""
        computed = self._computed_catch_up_seconds(seq)
        return min(computed, self._handed_off_seconds(seq)) if self.kv_handoff is not None else computed

    def _hands_off(self, seq: Sequence) -> bool:
        """Whether the draft's catch-up on `seq` is cheaper handed off than computed; without the
        draft's costs to weigh it by (a fixed K), always: a copy beat the draft's forward at
        every length measured."""
        if self.kv_handoff is None:
            return False
        return self._draft is None or self._handed_off_seconds(seq) < self._computed_catch_up_seconds(seq)

    def _handed_off_seconds(self, seq: Sequence) -> float:
        assert self._draft is not None
        return self.handoff_cost.seconds(seq.draft_pending - 1) + self._draft.step(1)

    def _computed_catch_up_seconds(self, seq: Sequence) -> float:
        """The draft's forward over what it has not seen of `seq`: the table's seconds, their
        part past its widest measured chunk corrected by what catch-ups measured. The table as
        measured, not scaled by what the draft's steps took since: a catch-up is a prompt, or
        more tokens than a compiled step takes, and runs eager, as the table's wide chunks did,
        while the steps may run compiled graphs loaded after start-up."""
        assert self._draft is not None
        within, beyond = self._catch_up_forward(seq, self._draft)
        return within + self._catch_up_scale(catch_up_class(seq.draft_pending)) * beyond

    def _catch_up_scale(self, length_class: int) -> float:
        """The correction of catch-ups of `length_class`: its own, else the nearest class's that
        catch-ups measured (a shorter one first), else none."""
        if not self._catch_up_scales:
            return 1.0
        nearest = min(self._catch_up_scales, key=lambda c: (abs(c - length_class), c > length_class))
        return self._catch_up_scales[nearest].value

    @staticmethod
    def _catch_up_forward(seq: Sequence, draft: CostTable) -> tuple[float, float]:
        """The table's seconds for the forward that feeds the draft what it has not seen of
        `seq`: up to its widest measured chunk, and the rest. Its queries read only the context
        the draft holds (not the batch's: a prompt's catch-up reads nothing but itself). Past
        the widest chunk the table extends a line, but a chunk reads more of itself the wider
        it is (attention grows with its square), hence `_catch_up_scales`, one for each length
        class: a chat prompt's catch-up says little of a 2,000-token one's."""
        held = draft.at_context(max(float(seq.draft_valid), float(draft.base_context)))
        pending = max(seq.draft_pending, 1)
        within = held.seconds(1, min(pending, draft.widest_chunk))
        return within, held.seconds(1, pending) - within

    def _renting(self, candidates: list[tuple[Sequence, CatchUp]], round_s: float) -> set[str]:
        """The `candidates` (requests that may also look up, with their catch-ups) whose draft
        catch-up waits this round: each pays one only once waiting has cost it as much as the
        catch-up itself (the ski-rental rule, which in its simple model costs at most twice the
        better of the two choices made in hindsight; `_charge_rent` says what waiting costs).
        Meanwhile it drafts by lookup or decodes plainly, which shows whether its answer copies
        (its lookup trust) and whether it is short, the two things that decide whether seconds
        of a long prompt's catch-up are repaid. A catch-up of at most `RENT_FROM_ROUNDS` plain
        rounds (`round_s`; a chat prompt's) waits for none: lost, it costs little."""
        waiting = set()
        for s, catch_up in candidates:
            if catch_up.extra_s > RENT_FROM_ROUNDS * round_s and catch_up.extra_s > self._rent.get(s.slot_id, 0.0):
                waiting.add(s.slot_id)
        return waiting

    @staticmethod
    def _caught_up_rates(
        waiting: set[str], rates: RatePredictor, choice: SourceChoice, caps: dict[str, int], steps: dict[str, int],
    ) -> dict[str, float]:
        """For each `waiting` request, the batch's best rate had its draft been caught up (its
        model draft at the best uniform K up to its cap, the others as chosen), where that beats
        the chosen rate: `_charge_rent` charges the round against it."""
        plain_steps = [steps.get(s.slot_id, 1) for s in rates.seqs] if steps else None
        chosen_rate = rates.rate(choice.ks, choice.on_lookup, plain_steps)
        caught_up = replace(rates, catch_ups=[CatchUp() if s.slot_id in waiting else c
                                              for s, c in zip(rates.seqs, rates.catch_ups)])
        out = {}
        for slot in waiting:
            ks, on_lookup = dict(choice.ks), set(choice.on_lookup) - {slot}
            best_rate = chosen_rate
            for k in range(1, caps[slot] + 1):
                ks[slot] = k
                best_rate = max(best_rate, caught_up.rate(ks, on_lookup, plain_steps))
            if best_rate > chosen_rate:
                out[slot] = best_rate
        return out

    def _charge_rent(self, plan: RoundPlan, seqs: list[Sequence], report: RoundReport) -> None:
        """Add to each waiting request's rent what its wait cost the round: the round's time
        past the time its tokens would have taken at the rate with that request's draft caught
        up (`RoundPlan.caught_up_rates`). Renting's price is the saving it forgoes, measured on
        the tokens the round did emit: a round whose lookups beat the caught-up draft costs
        nothing, so a catch-up whose draft never pays is never bought, while lookups that
        promise more than they yield cost the rent they lose."""
        if not plan.caught_up_rates:
            return
        emitted = sum(report.emitted(s.slot_id) for s in seqs)
        for slot, rate in plan.caught_up_rates.items():
            self._rent[slot] = self._rent.get(slot, 0.0) + max(0.0, report.total_s - emitted / rate)
            log.debug("catch-up of %s waits: %.2f s rented", slot, self._rent[slot])

    def _probe_affordable(self, seq: Sequence, model: RoundCostModel, plain_round: float, batch_size: int) -> bool:
        """A probe's catch-up may cost at most `probe_budget` of the request's remaining plain
        decoding, shared with the rest of the batch: a catch-up stalls every stream in its
        round, and each of them may probe in turn. The first probe of all is always
        affordable: the prior α alone must not keep a gateway from ever measuring its draft."""
        if model.draft is None:
            return False
        if not self._measured_alpha:
            return True
        cost = self._catch_up_seconds(seq) + (self.probe_k - 1) * model.draft.step(1)
        remaining_s = (seq.max_new_tokens - seq.completion_tokens) * plain_round
        return cost * batch_size <= self.probe_budget * remaining_s

    def _schedule_probe(
        self, flexible: list[Sequence], ks: dict[str, int], caps: dict[str, int],
        worth_probing: Callable[[Sequence], bool]
    ) -> None:
        """Count rounds off per request; of those past their interval, the one off longest
        that is worth probing drafts `probe_k` tokens. A due request found not worth probing
        is asked again after as many rounds as the batch has flexible requests: next round
        when alone (its probe window is short, since a catch-up only grows dearer), about one
        question per round in any batch: each question is a dozen rate predictions."""
        due = []
        for s in flexible:
            slot = s.slot_id
            if ks[slot] > 0:
                if slot not in self._probing:  # chosen on its merits: speculation pays again
                    self._probe_interval.pop(slot, None)
                self._idle_rounds[slot] = 0
                continue
            if slot in self._probing:  # the last probe did not turn it back on: back off
                self._probe_interval[slot] = min(2 * self._probe_interval.get(slot, self.probe_every),
                                                 self.max_probe_every)
            idle = self._idle_rounds.get(slot, 0) + 1
            self._idle_rounds[slot] = idle
            if idle >= self._probe_interval.get(slot, self.probe_every):
                due.append((idle, s))
        self._probing = set()
        for _, s in sorted(due, key=lambda pair: pair[0], reverse=True):
            if worth_probing(s):
                ks[s.slot_id] = min(self.probe_k, caps[s.slot_id])
                self._idle_rounds[s.slot_id] = 0
                self._probing.add(s.slot_id)
                return
            interval = self._probe_interval.get(s.slot_id, self.probe_every)
            self._idle_rounds[s.slot_id] = max(0, interval - len(flexible))

    def observe(self, plan: RoundPlan, seqs: list[Sequence], report: RoundReport) -> None:
        """Learn from a finished round of `plan`: acceptance per request and lookup kind, cost
        scales, overhead."""
        for seq in seqs:
            k, accepted = report.ks[seq.slot_id], report.num_accepted[seq.slot_id]
            lookup = plan.lookups.get(seq.slot_id)
            if k == 0:
                continue
            if lookup is not None:
                self.observe_lookup(lookup, k, accepted, seq.slot_id)
                continue
            estimate = self._estimates.get(seq.slot_id)
            if estimate is None:
                estimate = self.global_alpha.fork(self.request_weight)
                self._estimates[seq.slot_id] = estimate
            estimate.observe(k, accepted)
            self.global_alpha.observe(k, accepted)
            self._measured_alpha = True
        self._judge_offered(plan, seqs)
        for tokens, seconds in report.handoffs.values():
            self.handoff_cost.observe(tokens, seconds)
        self._charge_rent(plan, seqs, report)
        self._observe_self_guesses(plan, report)
        ks = [report.ks[s.slot_id] for s in seqs]
        drafts = [0 if s.slot_id in plan.lookups else k for s, k in zip(seqs, ks)]  # the model draft's
        if self._target is not None:  # the unscaled tables' prediction: the EMAs track the ratio
            unscaled = RoundCostModel(*self._at_context(plan.context))
            steps = [report.steps_of(s.slot_id) for s in seqs]
            predicted = unscaled.verify_seconds(ks, steps)
            self._target_scale.observe_ratio(report.verify.compute_s, predicted, self.cost_weight)
            if any(drafts):
                guesses = [len(g.tokens) if (g := plan.guesses.get(s.slot_id)) else 0 for s in seqs]
                feeds = [plan.feeds.get(s.slot_id, 1) + guess for s, guess in zip(seqs, guesses)]
                saved = ([float(report.guessed.get(s.slot_id, 0)) for s in seqs]
                         if any(guesses) or any(report.guessed.values()) else None)
                widened = [float(report.own_guess_tokens.get(s.slot_id, 0)) for s in seqs]
                predicted = unscaled.draft_seconds(drafts, feeds, saved, widened if any(widened) else None)
                if not plan.catching_up:
                    self._draft_scale.observe_ratio(report.propose.compute_s, predicted, self.cost_weight)
                elif plan.catch_up_beyond_s > 0:  # the Propose's time past its steps was the catch-ups'
                    rest = predicted * self._draft_scale.value + plan.catch_up_s - plan.catch_up_beyond_s
                    scale = self._catch_up_scales.setdefault(catch_up_class(plan.catch_up_tokens), _Scale())
                    scale.observe_ratio(report.propose.compute_s - rest, plan.catch_up_beyond_s, self.cost_weight)
        self._observe_overhead(sum(drafts), sum(ks) - sum(drafts), report.overhead_s)

    def _observe_self_guesses(self, plan: RoundPlan, report: RoundReport) -> None:
        """Learn what the guesses did each request whose draft guessed with its own lookup, per
        step of the K - 1 after the first forward: the steps saved and the own tokens fed."""
        for slot in plan.self_guessing:
            k = report.ks.get(slot, 0)
            if k >= 2:
                saved, fed = report.guessed.get(slot, 0), report.own_guess_tokens.get(slot, 0)
                self._self_guesses.setdefault(slot, SelfGuessEstimate()).observe(k, saved, fed, self.cost_weight)
                self._global_self_guesses.observe(k, saved, fed, self.global_weight)

    def _judge_offered(self, plan: RoundPlan, seqs: list[Sequence]) -> None:
        """Learn from the lookups the round did not verify as if it had: each emitted token has
        the target's distribution given the ones before it, so it equals a lookup's token with
        probability p(t), which is exactly the chance that verifying the one-hot draft would keep
        it. A lookup passed over therefore still teaches its kind's α, and a low first estimate
        cannot keep lookups off for good."""
        for seq in seqs:
            offered = plan.offered.get(seq.slot_id)
            if offered is None:
                continue
            start, lookup = offered
            emitted = seq.tokens[start:]
            matched = lookup.agreeing(emitted)
            judged = matched + 1 if matched < min(len(lookup.tokens), len(emitted)) else matched
            self.observe_lookup(lookup, judged, matched, seq.slot_id)

    def _observe_overhead(self, drafted: int, looked_up: int, overhead_s: float) -> None:
        """A round's overhead beyond the services' compute: a plain round's, plus what each
        verified lookup token adds, plus what the model draft adds (`DraftOverhead`)."""
        excess = overhead_s - self.overhead_s
        if drafted == 0 and looked_up == 0:
            self.overhead_s += self.cost_weight * excess
        elif drafted == 0:
            per_token = max(0.0, excess) / looked_up
            self.lookup_token_overhead_s += self.cost_weight * (per_token - self.lookup_token_overhead_s)
        else:
            self.draft_overhead.observe(drafted, excess - self.lookup_token_overhead_s * looked_up)

    def forget(self, seq: Sequence) -> None:
        """Drop a finished request's state."""
        self._estimates.pop(seq.slot_id, None)
        self._self_guesses.pop(seq.slot_id, None)
        self._lookup_trust.pop(seq.slot_id, None)
        self._rent.pop(seq.slot_id, None)
        self._idle_rounds.pop(seq.slot_id, None)
        self._probe_interval.pop(seq.slot_id, None)
        self._probing.discard(seq.slot_id)
