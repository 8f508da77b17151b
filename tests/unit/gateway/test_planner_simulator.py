"""The adaptive planner against a simulated world (tests/support/planner_sim.py): scripted
slowdowns, acceptance that changes, a restart, and batches whose verify costs more, each run
with the planner's choice and with every fixed K on the same world and seed.

Over each scenario the planner's tokens per simulated second must come within `MARGIN` of the
best fixed K in hindsight (a K picked knowing the whole run), the model source may not stay off
longer than the exploration schedule allows, and drafting must resume after a slowdown ends.
A shortfall against the best fixed K raises `Shortfall`, so a scenario known to fall short can be
marked `xfail(raises=Shortfall)` while its other checks still fail the test.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from specdec.gateway.model_clients import Timed
from specdec.gateway.planner import Planner
from specdec.gateway.planner.costs import WARMUP_ROUNDS
from specdec.gateway.planner.exploration import FIRST_PROBE_ROUNDS, MAX_PROBE_ROUNDS
from specdec.gateway.rounds import RoundReport
from tests.support.planner_rounds import round_inputs, still
from tests.support.planner_sim import (
    ADAPTIVE,
    FIXED,
    Event,
    Hardware,
    Policy,
    Run,
    Simulation,
    World,
    best_fixed,
    constant,
    new_request,
    note_draft,
    ramp,
    restart_draft,
    simulate,
    switch,
    window,
)

#: The planner may yield at most this share of the best fixed K's tokens per second. Where it
#: sees every change (steady costs, both services slower together, a warm-up it is told of, a
#: restart, a slow drift, a batch-bound target) it stays within 3.5 % over seeds 0-4: its
#: prior's first rounds, its probes and a K chosen on a noisy α (weights of 0.02 per token)
#: cost that much; the rest is room for the seed (±2 %).
MARGIN = 0.05
#: A draft that never pays: its exploration may cost at most this share of plain decoding.
EXPLORATION_SHARE = 0.02
#: Rounds off without a source probe beyond the schedule's longest wait: while a service warms
#: up no probe starts (`WARMUP_ROUNDS`), and a round in which a request probes on its own
#: (`RequestProbes`) puts the source's probe off by that round.
OFF_ALLOWANCE = WARMUP_ROUNDS + 4
#: Candidate rounds after a slowdown ends (or the draft turns good) until the draft drafts on its
#: merits again: at most the schedule's longest wait (`MAX_PROBE_ROUNDS`, four times the first).
RESUME_ROUNDS = 4 * FIRST_PROBE_ROUNDS

#: A memory-bound target (a 9-token verify costs 1.3 steps, each request adds 5 %) and a draft
#: whose step costs 0.15 of the target's.
HARDWARE = Hardware()
#: A target whose every verified token of every request costs compute: a wide verify costs
#: more the larger the batch.
BATCH_BOUND = Hardware(target_compute_s=0.003)
GOOD = constant(0.8)
BATCH = 4
SLOW_START = World(HARDWARE, GOOD, draft_slowdown=window(0.0, 3.0, 5.0))


class Shortfall(AssertionError):
    """The planner's tokens per second fell below what the test allows."""


@dataclass(frozen=True)
class Outcome:
    run: Run
    best: Policy
    best_rate: float

    @property
    def ratio(self) -> float:
        return self.run.rate() / self.best_rate


def against_best_fixed(world: World, batch_size: int, span_s: float, seed: int = 0,
                       best: tuple[Policy, float] | None = None) -> Outcome:
    """The planner's run, and the best fixed K in hindsight on the same world and seed (`best`
    where the caller has it: events that only tell the planner change no fixed K's run)."""
    policy, rate = best or best_fixed(world, batch_size, span_s, seed)
    return Outcome(simulate(world, ADAPTIVE, batch_size, span_s, seed), policy, rate)


def check(outcome: Outcome, resume_after: float | None = None) -> None:
    """The schedule's bounds, drafting again `resume_after` (sim seconds), then the rate."""
    assert outcome.run.longest_off() <= MAX_PROBE_ROUNDS + OFF_ALLOWANCE, outcome.run.longest_off()
    if resume_after is not None:
        rounds = outcome.run.rounds_until_drafting(resume_after)
        assert rounds is not None and rounds <= RESUME_ROUNDS, rounds
    if outcome.ratio < 1 - MARGIN:
        raise Shortfall(f"adaptive {outcome.ratio:.3f} of {outcome.best}")


@pytest.fixture(scope="module")
def slow_start_best() -> tuple[Policy, float]:
    return best_fixed(SLOW_START, BATCH, 20.0)


@pytest.mark.parametrize("told", [
    pytest.param(False, marks=pytest.mark.xfail(strict=True, raises=Shortfall, reason=(
        "off during the slow seconds, the draft's first probe falls within them and fails, so it waits a "
        "doubled interval after them (0.94 of K=5); told of the warm-up, the planner is within 1 %"))),
    True,
], ids=["untold", "told"])
def test_a_draft_slow_in_its_first_seconds_drafts_again(told: bool, slow_start_best: tuple[Policy, float]) -> None:
    # Its steps cost 5x for 3 s (compiled graphs loading): told, the planner learns nothing from
    # them; not told, it turns the draft off, and a probe must turn it back on.
    world = replace(SLOW_START, events=(Event(0.0, note_draft(3)), Event(3.0, note_draft(0)))) if told else SLOW_START
    check(against_best_fixed(world, BATCH, 20.0, best=slow_start_best), resume_after=3.0)


def test_a_noisy_neighbour_burst() -> None:
    both = window(5.0, 25.0, 2.0)
    world = World(HARDWARE, GOOD, target_slowdown=both, draft_slowdown=both)
    check(against_best_fixed(world, BATCH, 30.0), resume_after=25.0)


@pytest.mark.parametrize(("before", "after"), [(0.9, 0.05), (0.05, 0.9)], ids=["turns_bad", "turns_good"])
def test_a_draft_whose_acceptance_changes_mid_run(before: float, after: float) -> None:
    # The tightest check: a draft that turned good shows only in probes of 2 tokens each, and α
    # climbs at about 1 / (outcomes seen) a token; over seeds 0-4 it takes 85-100 candidate rounds
    # to draft again, and the run gets 0.93-0.98 of the best fixed K (0.95 at this seed).
    outcome = against_best_fixed(World(HARDWARE, switch(15.0, before, after)), BATCH, 30.0)
    check(outcome, resume_after=15.0 if after > before else None)


def test_a_slow_acceptance_drift() -> None:
    check(against_best_fixed(World(HARDWARE, ramp(0.0, 24.0, 0.9, 0.2)), BATCH, 24.0))


def test_a_draft_restart_mid_run() -> None:
    # The restarted draft holds none of the requests (each catches up) and its first second is slow.
    world = World(HARDWARE, GOOD, draft_slowdown=window(12.0, 13.0, 5.0), events=(Event(12.0, restart_draft),))
    check(against_best_fixed(world, BATCH, 24.0), resume_after=13.0)


@pytest.mark.parametrize("batch_size", [1, 4, 16])
def test_a_target_that_slows_with_batch_size(batch_size: int) -> None:
    check(against_best_fixed(World(BATCH_BOUND, GOOD), batch_size, 20.0))


@pytest.mark.parametrize(("batch_size", "span_s"), [
    (1, 36.0),  # long enough for the wait to reach `MAX_PROBE_ROUNDS`
    (4, 20.0),
    (16, 15.0),
])
def test_a_draft_that_never_pays_costs_little_to_explore(batch_size: int, span_s: float) -> None:
    # Compared from the first round the draft is off: before, the prior α drafted, which is not exploring.
    world = World(HARDWARE, constant(0.01))
    run = simulate(world, ADAPTIVE, batch_size, span_s)
    assert run.longest_off() <= MAX_PROBE_ROUNDS + OFF_ALLOWANCE, run.longest_off()
    off = run.first_off()
    assert off is not None and off < 5.0, off
    ratio = run.rate(off) / simulate(world, FIXED[0], batch_size, span_s).rate(off)
    if ratio < 1 - EXPLORATION_SHARE:
        raise Shortfall(f"{ratio:.3f} of plain")


def test_a_draft_cost_learnt_while_slow_is_relearnt_by_rounds_that_follow_plain_ones() -> None:
    # The slow start at seed 1: the draft's cost is learnt at 5x; then, at that price, a round whose
    # draft has 2 tokens to feed stays plain and one with 3 (after a plain round) drafts K = 1, so
    # every round that drafts is a catch-up, and the price is still 5x seconds after the slowdown.
    sim = Simulation(SLOW_START, ADAPTIVE, BATCH, seed=1)
    sim.run(3.0)
    for _ in range(RESUME_ROUNDS):
        sim.round()
    assert sim.planner.costs.draft_scale.value < 2.0


def test_a_round_that_feeds_the_draft_three_tokens_teaches_its_step_cost() -> None:
    planner = Planner(*HARDWARE.tables(), clock=still)
    planner.costs.draft_scale.observe(5.0, 0.1, 0.0)  # learnt in a slow round
    seq = new_request("a", 32, 128, adaptive=True)
    seq.draft_valid = len(seq.tokens) - 3  # one plain round after a drafted one
    plan = planner.plan(round_inputs([seq], {"a": 8}))
    assert plan.ks["a"] > 0
    propose = HARDWARE.draft_seconds(1) * plan.ks["a"] + 2 * HARDWARE.catch_up_token_s  # at table speed
    verify = HARDWARE.target_seconds(1, plan.ks["a"] + 1)
    planner.observe(plan, [seq], RoundReport(plan.ks, {"a": 0}, Timed(None, propose, propose),
                                             Timed(None, verify, verify), 0.0, propose + verify))
    assert planner.costs.draft_scale.value < 5.0
