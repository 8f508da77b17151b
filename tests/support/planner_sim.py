"""A simulated world for the adaptive planner: scripted, time-varying truths, a fake clock, and
a batch of requests decoded round after round under one policy (the planner's choice, or a
fixed K), so a test can compare policies by tokens per simulated second.

What it models:

* the target's forward seconds as a function of (sim time, batch size, tokens per request):
  a step, a share of it per extra verified token and per extra request, and optionally a
  compute-bound term proportional to batch × tokens (a target that slows with batch size); a
  verify pads every request to the round's widest K + 1;
* the model draft's 1-token step seconds by batch size (step j over the requests with K >= j),
  and a per-token cost of a catch-up (the tokens a request's draft has not seen,
  `Request.draft_pending`, fed in its first step);
* a round overhead outside both services, plus a Propose overhead in rounds that draft;
* slowdowns of either service and the draft's acceptance α, each a function of sim time;
* B requests at all times, each with a prompt and `max_new_tokens` (a finished one is replaced
  by a fresh one whose prompt the draft never saw), their caches moved by the gateway's own
  `advance`;
* events at given sim times (a service's Info, a draft restart that drops its caches).

Each round the policy plans, each drafting request accepts a geometric count of its K tokens
(each accepted with probability α(t) given the ones before it were, from a seeded generator),
the round's seconds are the world's truth (what the planner learns from), and the planner's
clock advances by them. The planner starts from cost tables measured on the steady hardware
(before any slowdown). A fixed K needs no planner: each request drafts its cap.

What it leaves out: lookups and their sources, multi-step plain rounds, sampling and stop
tokens (a request ends at its length), context growth (a forward costs the same at any
context), KV handoffs, admission queues and preemption, draft failures and downtime, timing
noise, and per-request differences in α.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdec.cost_model import ForwardCost
from specdec.gateway.detokenizer import StopStringDetokenizer
from specdec.gateway.draft_sources import DraftSource
from specdec.gateway.model_clients import Timed
from specdec.gateway.planner import Planner, SourceState
from specdec.gateway.request import Request
from specdec.gateway.rounds import RoundPlan, RoundReport
from specdec.gateway.speculative_step import advance
from specdec.sampling.params import SamplingParams
from tests.support.planner_rounds import round_inputs

#: A quantity of the world as a function of sim time (seconds).
Truth = Callable[[float], float]
#: The most draft tokens a request may take a round (its cap within its room).
MAX_K = 8


def constant(value: float) -> Truth:
    return lambda t: value


def window(start: float, end: float, inside: float, outside: float = 1.0) -> Truth:
    """`inside` over [start, end), `outside` elsewhere."""
    return lambda t: inside if start <= t < end else outside


def switch(at: float, before: float, after: float) -> Truth:
    return lambda t: before if t < at else after


def ramp(start: float, end: float, first: float, last: float) -> Truth:
    """`first` until `start`, linear to `last` at `end`, `last` after."""
    return lambda t: first + (last - first) * min(1.0, max(0.0, (t - start) / (end - start)))


@dataclass(frozen=True)
class Hardware:
    """The services' steady costs (no slowdown)."""

    target_step_s: float = 0.040
    #: Share of a target step each extra token per request adds, and each extra request.
    target_width: float = 0.0375
    target_batch: float = 0.05
    #: Seconds per request and token on top (compute-bound: 0 for a memory-bound target).
    target_compute_s: float = 0.0
    draft_step_s: float = 0.006
    draft_batch: float = 0.05
    #: Seconds each token a draft forward feeds beyond the first adds, per request.
    catch_up_token_s: float = 0.0002
    overhead_s: float = 0.002
    propose_overhead_s: float = 0.001

    def target_seconds(self, batch: int, tokens: int) -> float:
        memory = self.target_step_s * (1 + self.target_width * (tokens - 1)) * (1 + self.target_batch * (batch - 1))
        return memory + self.target_compute_s * batch * tokens

    def draft_seconds(self, batch: int, tokens: int = 1) -> float:
        """One draft forward over `batch` requests feeding `tokens` each."""
        return self.draft_step_s * (1 + self.draft_batch * (batch - 1)) + self.catch_up_token_s * batch * (tokens - 1)

    def tables(self) -> tuple[list[ForwardCost], list[ForwardCost]]:
        """The start-up cost tables the services would measure on this hardware, steady."""
        target = [ForwardCost(b, t, self.target_seconds(b, t)) for b in (1, 4, 16) for t in (1, 2, 5, 9)]
        draft = [ForwardCost(b, t, self.draft_seconds(b, t)) for b in (1, 4, 16) for t in (1, 2, 5, 9, 17, 65)]
        return target, draft


@dataclass(frozen=True)
class Event:
    """Something that happens at sim time `at` (applied before the first round that starts
    after it): to the planner, and to the batch's requests."""

    at: float
    action: Callable[[Planner, list[Request]], None]


def note_draft(pending_graphs: int) -> Callable[[Planner, list[Request]], None]:
    """The draft's Info says it has `pending_graphs` compiled graphs to load."""
    return lambda planner, batch: planner.note_service("draft", pending_graphs)


def restart_draft(planner: Planner, batch: list[Request]) -> None:
    """The draft restarted: it holds none of the requests' tokens any more."""
    for s in batch:
        s.draft_valid = 0
    planner.service_restarted("draft")


@dataclass(frozen=True)
class World:
    hardware: Hardware
    alpha: Truth
    target_slowdown: Truth = constant(1.0)
    draft_slowdown: Truth = constant(1.0)
    events: tuple[Event, ...] = ()


@dataclass(frozen=True)
class Policy:
    """The planner's choice (`k` None, requests adaptive) or a fixed K for every request."""

    k: int | None = None

    @property
    def adaptive(self) -> bool:
        return self.k is None

    def cap(self, room: int) -> int:
        return min(MAX_K if self.k is None else self.k, room)

    def __str__(self) -> str:
        return "adaptive" if self.k is None else f"K={self.k}"


ADAPTIVE = Policy()
FIXED = tuple(Policy(k) for k in range(MAX_K + 1))


@dataclass(frozen=True)
class RoundLog:
    start: float
    seconds: float
    tokens: int
    #: The model source's state after planning (None: no request could draft with it).
    state: SourceState | None
    #: Some request drafts with the model this round (on merit or as a probe).
    drafts: bool


@dataclass
class Run:
    """A simulation's rounds and what they yielded."""

    rounds: list[RoundLog] = field(default_factory=list)

    def rate(self, since: float = 0.0) -> float:
        """Tokens per sim second over the rounds that start at `since` or later."""
        part = [r for r in self.rounds if r.start >= since]
        return sum(r.tokens for r in part) / sum(r.seconds for r in part)

    def longest_off(self, request_probes_count: bool = False) -> int:
        """The most candidate rounds in a row in which the model source was off without a probe
        of the source (state PROBING); with `request_probes_count`, a round in which a request's
        own probe drafts with the model (`RequestProbes`) breaks the run too."""
        longest = run = 0
        for r in self.rounds:
            if r.state is None:
                continue
            run = run + 1 if r.state is SourceState.OFF and not (request_probes_count and r.drafts) else 0
            longest = max(longest, run)
        return longest

    def first_off(self) -> float | None:
        """Sim time of the first round in which the model source was off (None: never)."""
        return next((r.start for r in self.rounds if r.state is SourceState.OFF), None)

    def rounds_until_drafting(self, since: float) -> int | None:
        """Candidate rounds from sim time `since` until the first in which the model source
        drafts on its merits (0: that round is the first from then; None: never)."""
        candidates = [r for r in self.rounds if r.start >= since and r.state is not None]
        return next((i for i, r in enumerate(candidates) if r.state is SourceState.DRAFTING), None)


def new_request(slot_id: str, prompt_len: int, max_new_tokens: int, adaptive: bool) -> Request:
    greedy = SamplingParams()
    return Request(
        slot_id=slot_id, prompt=list(range(prompt_len)), sampling=greedy, max_new_tokens=max_new_tokens,
        num_speculative_tokens=MAX_K, detokenizer=StopStringDetokenizer.__new__(StopStringDetokenizer),
        generator=torch.Generator(), draft_sampling=greedy, target_sampling=greedy, adaptive=adaptive,
    )


class Simulation:
    """One policy decoding in one world: B requests for `span_s` sim seconds (see the module
    docstring). `now` is the planner's clock."""

    def __init__(self, world: World, policy: Policy, batch_size: int, *, seed: int = 0, prompt_len: int = 32,
                 max_new_tokens: int = 128) -> None:
        self.world, self.policy = world, policy
        self.prompt_len, self.max_new_tokens = prompt_len, max_new_tokens
        self.clock = 0.0
        self.rng = random.Random(seed)
        self.planner = Planner(*world.hardware.tables(), clock=self.now)
        self.started = 0
        self.batch = [self._fresh() for _ in range(batch_size)]
        self.pending = sorted(world.events, key=lambda e: e.at)
        self.log = Run()

    def now(self) -> float:
        return self.clock

    def run(self, span_s: float) -> Run:
        while self.clock < span_s:
            self.round()
        return self.log

    def round(self) -> None:
        """Plan, draw the acceptances, time the round by the world, emit, and let the planner learn."""
        while self.pending and self.pending[0].at <= self.clock:
            self.pending.pop(0).action(self.planner, self.batch)
        caps = {s.slot_id: self.policy.cap(s.max_new_tokens - s.completion_tokens - 1) for s in self.batch}
        adaptive = {s.slot_id: self.policy.adaptive for s in self.batch}
        # A fixed K is every request's cap (`fixed_choice`): only the adaptive policy asks the planner.
        plan = self.planner.plan(round_inputs(self.batch, caps, adaptive)) if self.policy.adaptive else RoundPlan(caps)
        state = self._model_state(caps)
        alpha = self.world.alpha(self.clock)
        accepted = {slot: self._accepted(k, alpha) for slot, k in plan.ks.items()}
        report = self._report(plan, accepted)
        emitted = sum(n + 1 for n in accepted.values())
        self.log.rounds.append(RoundLog(self.clock, report.total_s, emitted, state, plan.drafts))
        self.clock += report.total_s
        self._emit(plan, accepted)
        if self.policy.adaptive:
            self.planner.observe(plan, self.batch, report)
        self._replace_finished()

    def _emit(self, plan: RoundPlan, accepted: dict[str, int]) -> None:
        """Each request takes its accepted tokens and one more; the caches move as the gateway's
        `advance` moves them (the draft holds all but the round's last draft token)."""
        for s in self.batch:
            k, n = plan.ks[s.slot_id], accepted[s.slot_id]
            advance(s, k, n)
            s.tokens.extend([7] * (n + 1))
            s.completion_tokens += n + 1
            s.counts.record(k, n)

    def _model_state(self, caps: dict[str, int]) -> SourceState | None:
        if not self.policy.adaptive or not any(caps.values()):
            return None
        status = self.planner.status().of(DraftSource.MODEL)
        return status.state if status is not None else None

    def _accepted(self, k: int, alpha: float) -> int:
        n = 0
        while n < k and self.rng.random() < alpha:
            n += 1
        return n

    def _report(self, plan: RoundPlan, accepted: dict[str, int]) -> RoundReport:
        """The round as the services would time it: the world's truth now."""
        hardware = self.world.hardware
        propose, verify = self._propose_seconds(plan), self._verify_seconds(plan)
        overhead = hardware.overhead_s + (hardware.propose_overhead_s if plan.drafts else 0.0)
        return RoundReport(dict(plan.ks), accepted, Timed(None, propose, propose), Timed(None, verify, verify), 0.0,
                           propose + verify + overhead)

    def _verify_seconds(self, plan: RoundPlan) -> float:
        """One target forward over the batch, each request padded to the widest K + 1."""
        widest = max(plan.ks.values(), default=0)
        return self.world.target_slowdown(self.clock) * self.world.hardware.target_seconds(len(self.batch), widest + 1)

    def _propose_seconds(self, plan: RoundPlan) -> float:
        """The draft's steps, step j over the requests with K >= j, and its catch-ups: each
        drafting request feeds what the draft has not seen in its first step."""
        hardware, ks = self.world.hardware, [plan.ks[s.slot_id] for s in self.batch]
        steps = sum(hardware.draft_seconds(sum(k >= j for k in ks)) for j in range(1, max(ks, default=0) + 1))
        fed = sum(max(0, s.draft_pending - 1) for s, k in zip(self.batch, ks) if k > 0)
        return self.world.draft_slowdown(self.clock) * (steps + hardware.catch_up_token_s * fed)

    def _replace_finished(self) -> None:
        for i, s in enumerate(self.batch):
            if s.completion_tokens >= s.max_new_tokens:
                self.planner.forget(s)
                self.batch[i] = self._fresh()

    def _fresh(self) -> Request:
        self.started += 1
        return new_request(f"r{self.started}", self.prompt_len, self.max_new_tokens, self.policy.adaptive)


def simulate(world: World, policy: Policy, batch_size: int, span_s: float, seed: int = 0) -> Run:
    return Simulation(world, policy, batch_size, seed=seed).run(span_s)


def best_fixed(world: World, batch_size: int, span_s: float, seed: int = 0, since: float = 0.0,
               ) -> tuple[Policy, float]:
    """The fixed K with the most tokens per sim second (over the rounds from `since`) in
    hindsight, on the same world and seed, and that rate."""
    rates = {p: simulate(world, p, batch_size, span_s, seed).rate(since) for p in FIXED}
    best = max(rates, key=lambda p: rates[p])
    return best, rates[best]
