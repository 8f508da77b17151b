"""The planner's online estimates: moving averages that start by averaging and age while unfed.

Every estimate here is an exponential moving average whose first samples are averaged rather
than nudged (a poor starting value is gone within a few), and every one ages: a sample that
comes after a long gap counts for more (`staleness_weight`), so what was learnt minutes ago,
or on a machine that was busy then, cannot outweigh what the planner measures now. The
planner's scheduled probes (`specdec.gateway.planner.exploration`) make sure such samples come.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specdec.gateway.planner.rates import SelfGuessRates

#: Seconds after which an unfed cost estimate counts its next sample half (`staleness_weight`).
COST_HALF_LIFE_S = 10.0
#: Seconds after which an unfed acceptance estimate counts half as many past outcomes.
ACCEPTANCE_HALF_LIFE_S = 60.0


def staleness_weight(gap_s: float, half_life_s: float = COST_HALF_LIFE_S) -> float:
    """The least weight of a sample that comes `gap_s` after the estimate's last one: 0 right
    after it, 1/2 one half-life later, → 1 as the estimate goes stale."""
    return 1.0 - math.pow(0.5, max(gap_s, 0.0) / half_life_s)


@dataclass
class Mean:
    """EMA of a measured quantity: the n-th sample weighs max(`weight`, 1 / n, its staleness)."""

    value: float = 0.0
    seen: int = 0
    #: When it last took a sample (None: never).
    at: float | None = None

    def observe(self, x: float, weight: float, now: float) -> None:
        self.seen += 1
        stale = staleness_weight(now - self.at) if self.at is not None else 0.0
        self.value += max(weight, 1.0 / self.seen, stale) * (x - self.value)
        self.at = now


@dataclass
class Scale(Mean):
    """Measured ÷ predicted seconds of one service, averaged as `Mean`: a cost table timed on a
    busy machine is corrected within the first rounds that use it."""

    value: float = 1.0

    def observe_ratio(self, measured: float, predicted: float, weight: float, now: float) -> None:
        if measured > 0 and predicted > 0:
            self.observe(measured / predicted, weight, now)


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
    max(`weight`, 1 / (seen + n + 1)), so the first outcomes are averaged, not nudged. While no
    outcome comes, `seen` halves every `ACCEPTANCE_HALF_LIFE_S` (`observe`'s `now`), so an old
    estimate yields to new outcomes faster.
    """

    alpha: float
    weight: float
    #: Outcomes the starting value stands for, beyond the prior's one; grows as outcomes come.
    seen: float = 0
    at: float | None = None

    @property
    def alphas(self) -> list[float]:
        """α for position 1, which every later position reuses (see `expected_tokens`)."""
        return [self.alpha]

    def observe(self, k: int, num_accepted: int, now: float | None = None) -> None:
        """A round drafted k tokens and the first `num_accepted` were accepted."""
        if now is not None:
            if self.at is not None:
                self.seen *= 1.0 - staleness_weight(now - self.at, ACCEPTANCE_HALF_LIFE_S)
            self.at = now
        for j in range(min(num_accepted + 1, k)):
            self.seen += 1
            outcome = 1.0 if j < num_accepted else 0.0
            self.alpha += max(self.weight, 1.0 / (self.seen + 1)) * (outcome - self.alpha)

    def fork(self, weight: float) -> AcceptanceEstimate:
        """A copy that goes on learning at `weight` (a request's own estimate)."""
        return AcceptanceEstimate(self.alpha, weight, self.seen, self.at)


@dataclass
class DraftOverhead:
    """What drafting adds to a round's overhead: ``per_round + per_token * Σk``, fit online
    by exponentially weighted least squares over the rounds that drafted.

    Until those rounds drafted different totals Σk the split is unknown, and all of it is
    put on the tokens. Charging a fixed Propose cost per token would make long K look too
    dear. A round after a long gap weighs as `staleness_weight` says.
    """

    weight: float
    per_round: float = 0.0
    per_token: float = 0.0
    #: Weighted means of Σk, the excess overhead, Σk² and Σk × excess (empty before any round).
    _means: list[float] = field(default_factory=list)
    at: float | None = None

    def restart(self) -> None:
        """The next round's sample replaces the fit (which stands until then)."""
        self._means = []

    def observe(self, drafted: int, excess_s: float, now: float = 0.0) -> None:
        """A round drafted `drafted` tokens in all and its overhead exceeded a plain round's by `excess_s`."""
        sample = [float(drafted), excess_s, float(drafted * drafted), drafted * excess_s]
        weight = max(self.weight, staleness_weight(now - self.at) if self.at is not None else 0.0)
        self.at = now
        if not self._means:
            self._means = sample
        else:
            self._means = [m + weight * (x - m) for m, x in zip(self._means, sample)]
        mean_k, mean_y, mean_kk, mean_ky = self._means
        variance = mean_kk - mean_k * mean_k
        slope = (mean_ky - mean_k * mean_y) / variance if variance > 0.25 else -1.0
        if 0.0 <= slope <= mean_y / mean_k:
            self.per_token, self.per_round = slope, mean_y - slope * mean_k
        else:  # no spread in Σk yet, or a fit outside [all per round, all per token]
            self.per_token, self.per_round = max(mean_y, 0.0) / mean_k, 0.0


@dataclass
class SelfGuessEstimate:
    """What guesses did in a request's model rounds whose draft guesses on its own, per step
    after the first forward: the share of steps they saved, and the tokens of the draft's own
    guesses fed (each a token of width)."""

    saved: Mean = field(default_factory=Mean)
    fed: Mean = field(default_factory=Mean)

    def observe(self, k: int, saved: int, fed: int, weight: float, now: float) -> None:
        self.saved.observe(saved / (k - 1), weight, now)
        self.fed.observe(fed / (k - 1), weight, now)

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
