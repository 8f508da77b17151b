"""The model draft's acceptance as the planner estimates it: over all requests (where a new
request starts) and per request, and what the draft's own lookup guesses save."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.gateway.planner.estimates import AcceptanceEstimate, SelfGuessEstimate
from specdec.gateway.planner.rates import SelfGuessRates
from specdec.gateway.request import Request
from specdec.gateway.rounds import RoundPlan, RoundReport

#: What the estimate a probe re-measures keeps of its past: as many outcomes as this.
PROBE_PRIOR_OUTCOMES = 2


@dataclass
class ModelAcceptance:
    #: Prior acceptance before any draft token was judged.
    prior_alpha: float = 0.8
    #: EMA weights per judged draft token: a request's own acceptance, and the batch-wide one
    #: new requests start from. Acceptance is nearly memoryless (rounds of K tokens yield close
    #: to the geometric 1 + α + … + α^K), so a rejection says little about the next round: slow
    #: weights (docs/performance.md#adaptive-k-planner-rules).
    request_weight: float = 0.02
    global_weight: float = 0.01
    overall: AcceptanceEstimate = field(init=False)
    #: Whether any round with draft tokens has been observed (α is more than the prior).
    measured: bool = field(default=False, init=False)
    _requests: dict[str, AcceptanceEstimate] = field(default_factory=dict, init=False)
    #: What guesses do in the model rounds of each request whose draft guesses with its own
    #: lookup (`RoundPlan.self_guessing`), and over all of them (a new request's first estimate).
    _self_guesses: dict[str, SelfGuessEstimate] = field(default_factory=dict, init=False)
    _all_self_guesses: SelfGuessEstimate = field(default_factory=SelfGuessEstimate, init=False)

    def __post_init__(self) -> None:
        self.overall = AcceptanceEstimate(self.prior_alpha, self.global_weight)

    def reset(self) -> None:
        """The draft is another model now: what its predecessor's tokens taught does not hold."""
        self.overall, self.measured = AcceptanceEstimate(self.prior_alpha, self.global_weight), False
        self._requests.clear()

    def remeasure(self, slot_id: str) -> None:
        """A probe of the draft begins on `slot_id`: its outcomes count as much as the last
        `PROBE_PRIOR_OUTCOMES` outcomes together, so a draft that turned good shows within a
        probe or two (an estimate held by many old outcomes would need dozens)."""
        for estimate in (self.overall, self._requests.get(slot_id)):
            if estimate is not None:
                estimate.seen = min(estimate.seen, PROBE_PRIOR_OUTCOMES)

    def alphas(self, seq: Request) -> list[float]:
        estimate = self._requests.get(seq.slot_id)
        return estimate.alphas if estimate is not None else self.overall.alphas

    def observe(self, slot_id: str, k: int, num_accepted: int, now: float) -> None:
        estimate = self._requests.get(slot_id)
        if estimate is None:
            estimate = self._requests[slot_id] = self.overall.fork(self.request_weight)
        estimate.observe(k, num_accepted, now)
        self.overall.observe(k, num_accepted, now)
        self.measured = True

    def observe_self_guesses(self, plan: RoundPlan, report: RoundReport, weight: float, now: float) -> None:
        """Learn what the guesses did each request whose draft guessed with its own lookup, per
        step of the K - 1 after the first forward: the steps saved and the own tokens fed."""
        for slot in plan.self_guessing:
            k = report.ks.get(slot, 0)
            if k >= 2:
                saved, fed = report.guessed.get(slot, 0), report.own_guess_tokens.get(slot, 0)
                self._self_guesses.setdefault(slot, SelfGuessEstimate()).observe(k, saved, fed, weight, now)
                self._all_self_guesses.observe(k, saved, fed, self.global_weight, now)

    def self_guess_rates(self, seq: Request) -> SelfGuessRates:
        """What guesses are expected to do in the request's model rounds while its draft guesses
        on its own: its own estimate, else the one over all requests."""
        return self._self_guesses.get(seq.slot_id, self._all_self_guesses).rates

    def forget(self, slot_id: str) -> None:
        self._requests.pop(slot_id, None)
        self._self_guesses.pop(slot_id, None)
