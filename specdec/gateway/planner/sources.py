"""Each draft source's state from round to round: whether it drafted on its merits, why it is off,
its probes (`exploration`), and the status the planner shows (`status`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from specdec.gateway.draft_sources import DraftSource
from specdec.gateway.planner.acceptance import ModelAcceptance
from specdec.gateway.planner.catch_up import CatchUpPricer
from specdec.gateway.planner.choice import off_cause
from specdec.gateway.planner.costs import CostEstimates
from specdec.gateway.planner.exploration import PROBE_K, SourceTrack
from specdec.gateway.planner.inputs import RoundInputs
from specdec.gateway.planner.lookups import LookupEstimates
from specdec.gateway.planner.rates import RatePredictor, SourceChoice
from specdec.gateway.planner.status import PlannerStatus, SourceState, SourceStatus, SwitchReason
from specdec.gateway.request import Request


@dataclass
class SourceDecisions:
    tracks: dict[DraftSource, SourceTrack]
    costs: CostEstimates
    acceptance: ModelAcceptance
    lookups: LookupEstimates
    catch_ups: CatchUpPricer
    #: This round's candidates per source (adaptive requests that could draft with it), and
    #: whether it drafted for one of them on its merits.
    _candidates: dict[DraftSource, list[Request]] = field(default_factory=dict)
    _merit: dict[DraftSource, bool] = field(default_factory=dict)
    _rates: RatePredictor | None = None
    _renting: set[str] = field(default_factory=set)
    expected_speedup: float = 1.0
    #: Decoding seconds since any source last drafted on its merits.
    off_s: float = 0.0

    def chosen(self, inputs: RoundInputs, flexible: list[Request], choice: SourceChoice, rates: RatePredictor,
               steps: dict[str, int], renting: set[str]) -> None:
        """Record the planner's choice on the estimates alone (before any probe). Requests
        `renting` (waiting before a long catch-up) are candidates, but a probe skips them."""
        self._renting = renting
        model_ok = inputs.model_allowed
        self._candidates = {DraftSource.MODEL: [s for s in flexible if s.slot_id in model_ok]}
        for s in flexible:
            lookup = inputs.lookups.get(s.slot_id)
            if lookup is not None:
                self._candidates.setdefault(lookup.source, []).append(s)
        self._merit = {source: any(choice.ks[s.slot_id] > 0 and self._source_of(s, choice, inputs) is source
                                   for s in seqs) for source, seqs in self._candidates.items()}
        self._rates = rates
        plain_steps = [steps.get(s.slot_id, 1) for s in rates.seqs]
        plain = rates.rate(dict.fromkeys(choice.ks, 0), frozenset(), plain_steps)
        self.expected_speedup = rates.rate(choice.ks, choice.on_lookup, plain_steps) / plain if plain > 0 else 1.0

    @staticmethod
    def _source_of(seq: Request, choice: SourceChoice, inputs: RoundInputs) -> DraftSource:
        return inputs.lookups[seq.slot_id].source if seq.slot_id in choice.on_lookup else DraftSource.MODEL

    def track(self, inputs: RoundInputs, choice: SourceChoice) -> None:
        """Move each source with candidates on its state machine, and run the probes that are due."""
        assert self._rates is not None
        rates = self._rates
        for source, candidates in self._candidates.items():
            if not candidates or source not in self.tracks:
                continue
            track = self.tracks[source]
            track.decide(self._merit[source], partial(off_cause, source, rates, choice, candidates, inputs.caps),
                         partial(self._numbers, source, len(inputs.batch)))
            if not self._merit[source] and not self._drafts(source, candidates, choice, inputs):
                self._probe(track, candidates, choice, inputs)

    def _drafts(self, source: DraftSource, candidates: list[Request], choice: SourceChoice,
                inputs: RoundInputs) -> bool:
        return any(choice.ks[s.slot_id] > 0 and self._source_of(s, choice, inputs) is source for s in candidates)

    def _probe(self, track: SourceTrack, candidates: list[Request], choice: SourceChoice, inputs: RoundInputs) -> None:
        """Draft with the source for one candidate, if its probe is due: the request it probed
        last round (a model probe lasts two), else the cheapest to probe of those decoding
        plainly, else of all."""
        if not track.may_probe():
            return  # checked before the candidates are priced: a catch-up per request adds up at 16
        if track.source is DraftSource.MODEL and not self.costs.warmup.steady and track.probe_rounds_left == 0:
            return  # what it would measure now is not learnt from
        ongoing = [s for s in candidates if s.slot_id == track.probe_slot and track.probe_rounds_left > 0]
        affordable = [s for s in candidates if s.slot_id not in self._renting]
        if not ongoing and not affordable:
            return
        # A request decoding plainly this round first: a probe should not displace another draft.
        seq = ongoing[0] if ongoing else min(
            affordable, key=lambda s: (choice.ks[s.slot_id] > 0, self._price(track.source, s)))
        if not track.probe_due(self._price(track.source, seq)):
            return
        slot, cap = seq.slot_id, inputs.caps[seq.slot_id]
        if track.source is DraftSource.MODEL:
            choice.set(slot, min(PROBE_K, cap), lookup=False)
            if track.probe_rounds_left == 0:  # a new probe: what it measures is the draft as it is now
                self.costs.remeasure_draft()
                self.acceptance.remeasure(slot)
        else:
            choice.set(slot, min(PROBE_K, cap, len(inputs.lookups[slot].tokens)), lookup=True)
        track.start_probe(slot)

    def _price(self, source: DraftSource, seq: Request) -> float:
        """What probing `source` on `seq` costs by the start-up tables (not their online scales,
        which may be what the probe is to correct): its catch-up and the probe's draft steps.
        A lookup's probe costs a few verified tokens: nothing to budget."""
        draft = self.costs.draft
        if source is not DraftSource.MODEL or draft is None:
            return 0.0
        return self.catch_ups.seconds(seq) + PROBE_K * draft.step(1)

    def drafting(self, source: DraftSource) -> bool:
        """Whether `source` is on: drafting for some requests on its merits lately."""
        track = self.tracks.get(source)
        return track is not None and track.state is SourceState.DRAFTING

    def draft_down(self, batch: list[Request]) -> None:
        """The draft cannot be called this round, with requests that would draft with it."""
        track = self.tracks.get(DraftSource.MODEL)
        if track is not None and any(s.adaptive for s in batch):
            track.unavailable(lambda: self._numbers(DraftSource.MODEL, len(batch)))
            self._candidates[DraftSource.MODEL] = [s for s in batch if s.adaptive]
            self._merit[DraftSource.MODEL] = False

    def ran(self, seconds: float) -> None:
        """The planned round took `seconds`: the sources off in it were off that long."""
        for source, candidates in self._candidates.items():
            if candidates and not self._merit.get(source, False) and source in self.tracks:
                self.tracks[source].ran(seconds)
        any_candidates = any(self._candidates.values())
        if any_candidates and not any(self._merit.values()):
            self.off_s += seconds
        elif any_candidates:
            self.off_s = 0.0
        self._candidates, self._merit = {}, {}

    def restarted(self, service: str) -> None:
        """A service (re)started: every source it serves is probed soon (the target serves all)."""
        for source, track in self.tracks.items():
            if service == "target" or source is DraftSource.MODEL:
                track.restarted()

    def _numbers(self, source: DraftSource, batch_size: int) -> str:
        return (f"draft/target step {self.costs.draft_cost_ratio():.2f}, acceptance {self._alpha(source):.2f}, "
                f"expected speedup {self.expected_speedup:.2f}, batch {batch_size}")

    def _alpha(self, source: DraftSource) -> float:
        return self.acceptance.overall.alpha if source is DraftSource.MODEL else self.lookups.source_alpha(source)

    def status(self) -> PlannerStatus:
        sources = tuple(
            SourceStatus(source, t.state, t.reason, t.off_s, self._alpha(source), t.next_probe_rounds)
            for source, t in self.tracks.items())
        switches = {(source, reason): n for source, t in self.tracks.items() for reason, n in t.switches.items()}
        return PlannerStatus(sources, self.costs.draft_cost_ratio(), self.expected_speedup, self.off_s, switches)


__all__ = ["SourceDecisions", "SourceState", "SwitchReason"]
