"""The planner: K and draft source per request each round (`plan`), and what it learns from the
round (`observe`).

Each round the planner predicts with `specdec.cost_model` the batch's tokens per second for
each uniform K up to the largest allowed (until past the rate's peak), keeps the best, and
turns speculation off for a request whose own drafting lowers the batch's rate (`choice`); a
lookup proposal replaces the model draft where it pays more (`lookups`), and a draft catch-up
is priced and, for a long prompt, rented (`catch_up`). K = 0 everywhere is plain decoding, so
speculation switches itself off when it does not pay. Its inputs are the services' forward
costs corrected online by what rounds measure (`costs`), and α per request and lookup kind
(`acceptance`, `lookups`). No source stays off on an estimate nothing refreshes: each is
probed on a bounded schedule (`exploration`), estimates age, and timings taken while a service
warms up are not learnt from. The rules and their reasons: docs/architecture.md#adaptive-k.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from specdec.cost_model import ForwardCost, RoundCostModel
from specdec.gateway.draft_sources import DraftSource
from specdec.gateway.kv_handoff import KVHandoff
from specdec.gateway.planner.acceptance import ModelAcceptance
from specdec.gateway.planner.catch_up import MAX_ROUND_FEED, CatchUpPricer, round_feed
from specdec.gateway.planner.choice import choose
from specdec.gateway.planner.costs import CostEstimates
from specdec.gateway.planner.exploration import RequestProbes, new_tracks
from specdec.gateway.planner.inputs import LOOKUP_PLAIN_STREAK, DraftAvailability, PlannerSettings, RoundInputs
from specdec.gateway.planner.lookups import LookupEstimates, best_guesses, guess_cuts
from specdec.gateway.planner.rates import RatePredictor, SelfGuessRates, SourceChoice, fixed_choice, fixed_guesses
from specdec.gateway.planner.sources import SourceDecisions
from specdec.gateway.planner.status import PlannerStatus
from specdec.gateway.proposers import LookupDraft
from specdec.gateway.request import Request
from specdec.gateway.rounds import RoundPlan, RoundReport


@dataclass
class Decision:
    """What the planner chose for the requests whose K was its to choose, and the rates behind it."""

    rates: RatePredictor
    off_reason: str | None = None
    caught_up_rates: dict[str, float] = field(default_factory=dict)
    guesses: dict[str, LookupDraft] = field(default_factory=dict)
    #: Requests whose draft catch-up waits (`CatchUpPricer.renting`).
    waiting: set[str] = field(default_factory=set)


class Planner:
    """Plans K and draft source per request and round; see the module docstring."""

    def __init__(
        self, target_costs: Sequence[ForwardCost], draft_costs: Sequence[ForwardCost],
        settings: PlannerSettings | None = None, *, uses_draft: bool = True, guesses: bool = True,
        kv_handoff: KVHandoff | None = None, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = s = settings or PlannerSettings()
        #: Whether this gateway has a draft model, and lets it guess with lookups (`RoundPlan.guesses`).
        self.uses_draft, self.guesses, self.clock = uses_draft, guesses, clock
        self.costs = CostEstimates(target_costs, draft_costs, s.cost_weight)
        self.acceptance = ModelAcceptance(s.prior_alpha, s.request_weight, s.global_weight)
        self.lookups = LookupEstimates(s.lookup_prior_alpha, s.lookup_weight)
        self.catch_ups = CatchUpPricer(self.costs, kv_handoff)
        self.request_probes = RequestProbes(s.probe_every, s.max_probe_every, s.probe_k)
        self.sources = SourceDecisions(new_tracks(uses_draft), self.costs, self.acceptance, self.lookups,
                                       self.catch_ups)

    @property
    def kv_handoff(self) -> KVHandoff | None:
        return self.catch_ups.kv_handoff

    @kv_handoff.setter
    def kv_handoff(self, handoff: KVHandoff | None) -> None:
        self.catch_ups.kv_handoff = handoff

    @property
    def can_adapt(self) -> bool:
        """The services advertised their costs: the target's, and the draft's where there is one."""
        return self.costs.target is not None and (self.costs.draft is not None or not self.uses_draft)

    def plan(self, inputs: RoundInputs) -> RoundPlan:
        """K and draft source per request: the planner's choice for adaptive requests, the
        request's own K (`fixed_choice`) for the others; then the sources' probes."""
        batch, caps, lookups = inputs.batch, inputs.caps, inputs.lookups
        model_ok, looking_up = inputs.model_allowed, inputs.looking_up
        steps = self._plain_steps(inputs, looking_up)
        choice = fixed_choice(batch, caps, lookups, model_ok)
        flexible = [s for s in batch if s.adaptive and caps[s.slot_id] > 0
                    and (s.slot_id in model_ok or s.slot_id in lookups)]
        decision = None
        if flexible and self.can_adapt:
            decision = self._decide(inputs, choice, flexible, steps, looking_up)
            self.sources.track(inputs, choice)
        guesses = decision.guesses if decision else fixed_guesses(batch, choice, caps, lookups if self.guesses else {})
        off_reason = decision.off_reason if decision else None
        if inputs.draft is DraftAvailability.DOWN and any(caps[s.slot_id] and s.method.allows_model for s in batch):
            off_reason = "draft_unavailable"
            self.sources.draft_down(batch)
        return self._round_plan(inputs, choice, steps, guesses, looking_up if self.guesses else set(),
                                off_reason, decision.caught_up_rates if decision else {})

    def _decide(self, inputs: RoundInputs, choice: SourceChoice, flexible: list[Request], steps: dict[str, int],
                looking_up: set[str]) -> Decision:
        """Choose for the `flexible` requests from the predicted rates, renting catch-ups and
        probing requests kept at K = 0 (`RequestProbes`)."""
        batch, caps, lookups = inputs.batch, inputs.caps, inputs.lookups
        model = self.costs.cost_model(inputs.context)
        plain_round = model.round_seconds([0] * len(batch))
        catch_ups = [self.catch_ups.catch_up(s, model) for s in batch]
        waiting = self.catch_ups.renting([(s, c) for s, c in zip(batch, catch_ups)
                                          if s in flexible and s.slot_id in looking_up], plain_round)
        model_ok = inputs.model_allowed - waiting
        own = looking_up if self.guesses else set()
        lookup_alphas = self.lookups.request_alphas(batch, lookups)
        rates = RatePredictor(
            model, batch, [self.acceptance.alphas(s) for s in batch], catch_ups, [round_feed(s) for s in batch],
            lookup_alphas, guess_cuts(model, batch, caps, lookups if self.guesses else {}, lookup_alphas, model_ok),
            [self.acceptance.self_guess_rates(s) if s.slot_id in own else SelfGuessRates() for s in batch])
        decision = Decision(rates, choose(rates, choice, flexible, caps, steps, lookups, model_ok), waiting=waiting)
        decision.caught_up_rates = self.catch_ups.caught_up_rates(waiting, rates, choice, caps, steps)
        decision.guesses = best_guesses(rates, choice, lookups) if self.guesses else {}
        self.sources.chosen(inputs, flexible, choice, rates, steps, waiting)

        def worth_probing(s: Request) -> bool:
            return self._probe_affordable(s, model, plain_round, len(batch)) and rates.probe_could_pay(
                s, choice.ks, caps, choice.on_lookup)

        if self.sources.drafting(DraftSource.MODEL):  # while it is off, the source's probes explore it
            self.request_probes.schedule([s for s in flexible if s.slot_id in model_ok], choice.ks, caps, worth_probing)
        return decision

    def _probe_affordable(self, seq: Request, model: RoundCostModel, plain_round: float, batch_size: int) -> bool:
        """A request's probe, its catch-up included, may cost at most `probe_budget` of its
        remaining plain decoding, shared with the batch (a catch-up stalls every stream in its
        round). The first probe of all is always affordable: the prior α alone must not keep a
        gateway from ever measuring its draft."""
        draft = model.draft
        if draft is None:
            return False
        if not self.acceptance.measured:
            return True
        cost = self.catch_ups.seconds(seq) + (self.settings.probe_k - 1) * draft.step(1)
        remaining_s = (seq.max_new_tokens - seq.completion_tokens) * plain_round
        return cost * batch_size <= self.settings.probe_budget * remaining_s

    def _plain_steps(self, inputs: RoundInputs, looking_up: set[str]) -> dict[str, int]:
        """Tokens a plain round decodes per request: as the scheduler allows, but one for a request
        that may draft by lookup, where calls are cheap (a lookup may match after any new token),
        until `LOOKUP_PLAIN_STREAK` plain rounds in a row show that none are paying."""
        cheap = self.costs.calls_are_cheap(len(inputs.batch))
        return {s.slot_id: 1 if cheap and s.slot_id in looking_up and s.counts.plain_streak < LOOKUP_PLAIN_STREAK
                else inputs.plain_steps.get(s.slot_id, 1) for s in inputs.batch}

    def _round_plan(self, inputs: RoundInputs, choice: SourceChoice, steps: dict[str, int],
                    guesses: dict[str, LookupDraft], own: set[str], off_reason: str | None,
                    caught_up_rates: dict[str, float]) -> RoundPlan:
        """The plan of `choice`: lookups verified, lookups offered, guesses, handoffs and catch-ups."""
        batch, ks, lookups = inputs.batch, choice.ks, inputs.lookups
        chosen = {slot: lookups[slot].truncated(ks[slot]) for slot in choice.on_lookup if ks[slot] > 0}
        model_drafted = [s for s in batch if ks[s.slot_id] > 0 and s.slot_id not in chosen]
        behind = [s for s in model_drafted if s.draft_pending > MAX_ROUND_FEED]
        handoffs = frozenset(s.slot_id for s in behind if self.catch_ups.hands_off(s))
        catching = [s for s in behind if s.slot_id not in handoffs]
        within, beyond = self.catch_ups.split(catching)
        return RoundPlan(
            ks=ks, steps={} if any(ks.values()) else steps, feeds={s.slot_id: round_feed(s) for s in batch},
            context=inputs.context, catching_up=bool(catching), off_reason=off_reason, lookups=chosen,
            offered={s.slot_id: (len(s.tokens), lookups[s.slot_id]) for s in batch
                     if s.slot_id in lookups and s.slot_id not in chosen},
            guesses={slot: g for slot, g in guesses.items() if ks[slot] > 0 and slot not in chosen},
            self_guessing={s.slot_id for s in model_drafted if s.slot_id in own},
            catch_up_s=within + beyond, catch_up_beyond_s=beyond,
            catch_up_tokens=max((s.draft_pending for s in catching), default=0),
            catch_up_feeds={s.slot_id: s.draft_pending for s in catching},
            caught_up_rates=caught_up_rates, handoffs=handoffs,
        )

    def observe(self, plan: RoundPlan, seqs: list[Request], report: RoundReport) -> None:
        """Learn from a finished round of `plan`: acceptance per request and lookup kind, costs,
        catch-ups, and how long each source has been off."""
        now = self.clock()
        for seq in seqs:
            k, accepted = report.ks[seq.slot_id], report.num_accepted[seq.slot_id]
            lookup = plan.lookups.get(seq.slot_id)
            if lookup is not None and lookup.source is DraftSource.GRAMMAR:
                continue  # a grammar's forced tokens: certain, nothing to learn
            if k > 0 and lookup is not None:
                self.lookups.observe(lookup, k, accepted, seq.slot_id, now)
            elif k > 0:
                self.acceptance.observe(seq.slot_id, k, accepted, now)
        self.lookups.judge_offered(plan, seqs, now)
        self.catch_ups.observe(plan, seqs, report)
        self.acceptance.observe_self_guesses(plan, report, self.settings.cost_weight, now)
        self.costs.observe(plan, seqs, report, now)
        self.sources.ran(report.total_s)

    def note_service(self, service: str, pending_graphs: int) -> None:
        """The service's latest Info: it warms up while it loads compiled graphs."""
        self.costs.warmup.note(service, pending_graphs)

    def service_restarted(self, service: str) -> None:
        """The service (re)started or answers again: its online corrections start afresh, it
        warms up, and the sources it serves are probed soon."""
        self.costs.restarted(service)
        self.sources.restarted(service)

    def set_costs(self, service: str, costs: Sequence[ForwardCost], *, same_model: bool = False) -> None:
        """A service came back changed (its Info), with these forward costs: plan with them; a
        draft that runs another model has its acceptance learnt afresh too."""
        self.costs.set_costs(service, costs)
        self.sources.restarted(service)
        if service == "draft" and not same_model:
            self.acceptance.reset()

    def status(self) -> PlannerStatus:
        rows = {"target": self.costs.target_rows.value, "draft": self.costs.draft_rows.value}
        return replace(self.sources.status(), forward_rows=rows)

    def forget(self, seq: Request) -> None:
        """Drop a finished request's state."""
        self.acceptance.forget(seq.slot_id)
        self.lookups.forget(seq.slot_id)
        self.catch_ups.rent.pop(seq.slot_id, None)
        self.request_probes.forget(seq.slot_id)
