"""The adaptive-K planner with synthetic costs and acceptance: no services, no models."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from specdec.cost_model import ForwardCost, RoundCostModel
from specdec.gateway.detokenizer import StopStringDetokenizer
from specdec.gateway.kv_handoff import HandoffCost, KVHandoff
from specdec.gateway.model_clients import Timed
from specdec.gateway.planner import Planner, PlannerSettings
from specdec.gateway.planner.catch_up import catch_up_forward
from specdec.gateway.planner.estimates import AcceptanceEstimate, DraftOverhead
from specdec.gateway.planner.exploration import FIRST_PROBE_ROUNDS, MODEL_PROBE_ROUNDS
from specdec.gateway.planner.rates import RatePredictor
from specdec.gateway.request import Request
from specdec.gateway.rounds import RoundPlan, RoundReport
from specdec.sampling.params import SamplingParams
from tests.support.planner_rounds import round_inputs, still

# A memory-bound target: a 9-token verify costs 1.3x a step, and batching is nearly free.
TARGET = [ForwardCost(b, t, 0.040 * (1 + 0.0375 * (t - 1)) * (1 + 0.05 * (b - 1)))
          for b in (1, 4, 16) for t in (1, 5, 9)]


def draft_costs(c: float) -> list[ForwardCost]:
    return [ForwardCost(b, 1, 0.040 * c * (1 + 0.05 * (b - 1))) for b in (1, 4, 16)]


def seq(slot: str) -> Request:
    greedy = SamplingParams()
    return Request(
        slot_id=slot, prompt=[1, 2, 3], sampling=greedy, max_new_tokens=100, num_speculative_tokens=8,
        detokenizer=StopStringDetokenizer.__new__(StopStringDetokenizer), generator=torch.Generator(),
        draft_sampling=greedy, target_sampling=greedy, adaptive=True,
    )


def feed(planner: Planner, seqs: list[Request], alpha: dict[str, float], rounds: int) -> RoundPlan:
    """Run `rounds` planned rounds where request r accepts each draft token with prob alpha[r];
    returns the last round's plan."""
    rng = torch.Generator().manual_seed(0)
    plan = RoundPlan({})
    for _ in range(rounds):
        plan = planner.plan(round_inputs(seqs, {s.slot_id: 8 for s in seqs}, {s.slot_id: True for s in seqs}))
        accepted = {}
        for s in seqs:
            draws = torch.rand(plan.ks[s.slot_id], generator=rng) < alpha[s.slot_id]
            accepted[s.slot_id] = int(draws.long().cumprod(0).sum()) if plan.ks[s.slot_id] else 0
        zero = Timed(None, 0.0, 0.0)
        planner.observe(plan, seqs, RoundReport(plan.ks, accepted, zero, zero, 0.0, 0.0))
    return plan


def test_acceptance_estimate_learns_from_judged_tokens_only() -> None:
    estimate = AcceptanceEstimate(0.5, weight=0.5, seen=10)
    estimate.observe(k=4, num_accepted=1)  # token 1 accepted, 2 rejected, 3-4 never judged
    assert estimate.alpha == pytest.approx(0.375)  # 0.5 -> 0.75 -> 0.375
    estimate.observe(k=2, num_accepted=2)  # both judged and accepted
    assert estimate.alphas == pytest.approx([0.84375])


def test_acceptance_estimate_averages_its_first_outcomes() -> None:
    estimate = AcceptanceEstimate(0.8, weight=0.05)
    estimate.observe(k=2, num_accepted=2)  # the prior counts as one outcome
    assert estimate.alpha == pytest.approx((0.8 + 2) / 3)
    estimate.observe(k=4, num_accepted=1)
    assert estimate.alpha == pytest.approx((0.8 + 3) / 5)
    request = estimate.fork(0.05)  # a request starts from the batch-wide estimate and its evidence
    request.observe(k=1, num_accepted=0)
    assert request.alpha == pytest.approx((0.8 + 3) / 6)
    for _ in range(100):  # later outcomes are nudged at the EMA weight
        estimate.observe(k=1, num_accepted=0)
    before = estimate.alpha
    estimate.observe(k=1, num_accepted=1)
    assert estimate.alpha == pytest.approx(before + 0.05 * (1 - before))


def test_one_late_rejection_does_not_shorten_k_for_good() -> None:
    # A good draft (α = 0.95) whose request once saw its 5th token rejected: pooled over all
    # judged tokens that is one miss in many, and K stays long.
    planner = Planner(TARGET, draft_costs(0.1), clock=still)
    a = seq("a")
    feed(planner, [a], {"a": 0.95}, rounds=20)
    zero = Timed(None, 0.0, 0.0)
    planner.observe(RoundPlan({"a": 8}), [a], RoundReport({"a": 8}, {"a": 4}, zero, zero, 0.0, 0.0))
    assert planner.plan(round_inputs([a], {"a": 8}, {"a": True})).ks["a"] >= 6


def test_good_cheap_draft_speculates_with_a_long_k() -> None:
    planner = Planner(TARGET, draft_costs(0.1), clock=still)
    ks = feed(planner, [seq("a")], {"a": 0.95}, rounds=40).ks
    assert ks["a"] >= 5


def test_weak_draft_turns_speculation_off_and_reprobes() -> None:
    planner = Planner(TARGET, draft_costs(0.3), PlannerSettings(probe_every=8), clock=still)
    a = seq("a")
    history = []
    for _ in range(40):
        plan = feed(planner, [a], {"a": 0.05}, rounds=1)
        history.append(plan.ks["a"])
    assert history[0] > 0  # the prior is optimistic: it tries first
    assert history[-16:].count(0) >= 13  # then stays off ...
    assert any(k > 0 for k in history[-16:])  # ... apart from the periodic probes
    assert plan.off_reason == "not_paying" or history[-1] > 0


def test_expensive_draft_never_pays() -> None:
    planner = Planner(TARGET, draft_costs(1.2), clock=still)
    ks = feed(planner, [seq("a")], {"a": 0.9}, rounds=5).ks
    assert ks["a"] == 0


def test_mixed_batch_drops_only_the_request_whose_draft_fails() -> None:
    planner = Planner(TARGET, draft_costs(0.1), clock=still)
    good, bad = seq("good"), seq("bad")
    ks = feed(planner, [good, bad], {"good": 0.95, "bad": 0.0}, rounds=30).ks
    assert ks["good"] >= 3 and ks["bad"] == 0


def test_fixed_requests_and_missing_costs_keep_their_cap() -> None:
    a, b = seq("a"), dataclasses.replace(seq("b"), adaptive=False)
    planner = Planner(TARGET, draft_costs(1.5), clock=still)
    assert planner.plan(round_inputs([a], {"a": 4}, {"a": True})).ks == {"a": 0}  # alone, a costly draft does not pay
    assert planner.plan(round_inputs([a, b], {"a": 4, "b": 0}, {"a": True, "b": False})).ks["b"] == 0
    assert planner.plan(round_inputs([b], {"b": 3}, {"b": False})).ks == {"b": 3}  # fixed K is kept whatever it costs
    no_costs = Planner(TARGET, [], clock=still)
    assert not no_costs.can_adapt
    assert no_costs.plan(round_inputs([a], {"a": 4}, {"a": True})).ks == {"a": 4}


def test_cost_scale_follows_the_measured_compute() -> None:
    planner = Planner(TARGET, draft_costs(0.1), PlannerSettings(cost_weight=0.5), clock=still)
    a = seq("a")
    report = RoundReport({"a": 0}, {"a": 0}, Timed(None, 0.0, 0.0), Timed(None, 0.080, 0.085), 0.0, 0.090)
    for _ in range(20):
        planner.observe(RoundPlan(report.ks), [a], report)
    assert planner.costs.cost_model().target.step(1) == pytest.approx(0.080, rel=1e-3)
    assert planner.costs.overhead_s == pytest.approx(0.010, rel=1e-3)


def test_rounds_in_forwards_merged_with_another_gateways_are_priced_for_those_forwards() -> None:
    """A service that merges two gateways' calls (`specdec.serving.call_merger`) answers each
    with the forward of both (`run_items`): the planner prices its rounds for that forward,
    and does not mistake the merged forward's time for a slower service."""
    planner = Planner(TARGET, draft_costs(0.1), PlannerSettings(cost_weight=0.5), clock=still)
    four = [seq(f"s{i}") for i in range(4)]
    ks = {s.slot_id: 4 for s in four}
    alone = planner.costs.cost_model()
    assert alone.draft is not None
    eight = RoundCostModel(alone.target.shared(2.0), alone.draft.shared(2.0))  # the forwards as they run
    verify_s, propose_s = eight.verify_seconds([4] * 4), eight.draft_seconds([4] * 4, [1] * 4)
    report = RoundReport(ks, ks, Timed(None, propose_s, propose_s, None, 8), Timed(None, verify_s, verify_s, None, 8),
                         0.0, 0.0)
    for _ in range(10):
        planner.observe(RoundPlan(ks, feeds={s.slot_id: 1 for s in four}), four, report)
    assert planner.status().forward_rows == {"target": pytest.approx(2.0), "draft": pytest.approx(2.0)}
    model = planner.costs.cost_model()
    assert model.verify_seconds([4] * 4) == pytest.approx(verify_s)
    assert model.target.scale == pytest.approx(1.0) and model.draft is not None
    assert model.draft.scale == pytest.approx(1.0)
    own = Timed(None, verify_s, verify_s, None, 4)  # the other gateway left: the forwards are its own again
    for _ in range(10):
        planner.observe(RoundPlan(ks), four, RoundReport(ks, ks, Timed(None, 0.0, 0.0), own, 0.0, 0.0))
    assert planner.status().forward_rows["target"] == pytest.approx(1.0, abs=0.01)
    assert planner.status().forward_rows["draft"] == pytest.approx(2.0)  # no Propose since: nothing learnt


def test_a_row_without_a_draft_is_priced_as_wide_as_the_drafted_rows_beside_it() -> None:
    """The target pads a batch's chunks to the longest, so a Verify of K = [0, 4, 4, 4] runs
    four rows of 5 tokens: the planner prices it so, and a round that cost just that teaches
    no slower target (priced at the mean width, 3 + 3/4 tokens a row, it would)."""
    planner = Planner(TARGET, draft_costs(0.1), PlannerSettings(cost_weight=0.5), clock=still)
    four = [seq(f"s{i}") for i in range(4)]
    ks = {"s0": 0, "s1": 4, "s2": 4, "s3": 4}
    padded = planner.costs.cost_model().target.seconds(4, 5)
    assert planner.costs.cost_model().verify_seconds(list(ks.values())) == pytest.approx(padded)
    report = RoundReport(ks, {**ks, "s0": 0}, Timed(None, 0.0, 0.0), Timed(None, padded, padded), 0.0, 0.0)
    for _ in range(10):
        planner.observe(RoundPlan(ks, feeds={s.slot_id: 1 for s in four}), four, report)
    assert planner.costs.cost_model().target.scale == pytest.approx(1.0)


def test_a_table_timed_on_a_busy_machine_is_corrected_by_the_first_rounds() -> None:
    # The draft timed itself while the machine was busy: its table says 3x what a step costs.
    # The first round that drafts sets the scale from what the draft reports, not a tenth of it.
    planner = Planner(TARGET, draft_costs(0.3), PlannerSettings(cost_weight=0.1), clock=still)
    a = seq("a")
    plan = RoundPlan({"a": 4}, feeds={"a": 1})
    truth = planner.costs.cost_model().draft_seconds([4], [1]) / 3
    verify_s = planner.costs.cost_model().verify_seconds([4])
    for _ in range(2):
        report = RoundReport({"a": 4}, {"a": 4}, Timed(None, truth, truth), Timed(None, verify_s, verify_s), 0.0, 0.0)
        planner.observe(plan, [a], report)
    model = planner.costs.cost_model()
    assert model.draft is not None and model.draft.scale == pytest.approx(1 / 3, rel=1e-3)
    assert model.target.scale == pytest.approx(1.0)


def test_a_multi_step_round_teaches_the_cost_of_one_step() -> None:
    """A plain round that decoded 4 tokens a request ran 4 forwards: its compute rescales
    the step cost by a quarter of it, and multi-step prices K = 0 higher."""
    planner = Planner(TARGET, draft_costs(0.1), PlannerSettings(cost_weight=0.5), clock=still)
    a = seq("a")
    report = RoundReport({"a": 0}, {"a": 0}, Timed(None, 0.0, 0.0), Timed(None, 0.320, 0.325), 0.0, 0.330,
                         steps={"a": 4})
    for _ in range(20):
        planner.observe(RoundPlan(report.ks), [a], report)
    assert planner.costs.cost_model().target.step(1) == pytest.approx(0.080, rel=1e-3)
    # A draft whose K = 1 barely beats one-step plain rounds loses to 4 steps a round.
    close = Planner(TARGET, draft_costs(0.4), clock=still)
    close.costs.overhead_s = 0.010
    close.acceptance.overall.alpha = 0.6
    assert close.plan(round_inputs([a], {"a": 8}, {"a": True})).ks["a"] > 0
    assert close.plan(round_inputs([a], {"a": 8}, {"a": True}, steps={"a": 4})).ks["a"] == 0


def test_probes_back_off_and_never_come_together() -> None:
    planner = Planner(TARGET, draft_costs(0.3), PlannerSettings(probe_every=4, max_probe_every=16), clock=still)
    seqs = [seq(f"r{i}") for i in range(3)]
    probe_rounds = []
    for round_index in range(80):
        ks = feed(planner, seqs, {s.slot_id: 0.0 for s in seqs}, rounds=1).ks
        probing = [slot for slot, k in ks.items() if k > 0]
        if round_index > 8:  # the optimistic prior has been corrected: every request is off
            assert len(probing) <= 1  # at most one request pays for a catch-up per round
            if probing:
                probe_rounds.append(round_index)
    gaps = [b - a for a, b in zip(probe_rounds, probe_rounds[1:])]
    assert gaps and max(gaps) >= 4  # intervals grew past the first one ...
    assert len(probe_rounds) <= 20  # ... so probes got rarer than one every 4 rounds


def test_a_draft_prefill_is_worth_it_only_for_a_long_enough_future() -> None:
    # A draft whose 9-token forward costs 8 steps: catching up on 60 tokens costs ~50 steps.
    costly_prefill = [*draft_costs(0.15), ForwardCost(1, 9, 0.040 * 0.15 * 8)]
    long_future, short_future = seq("long"), seq("short")
    for s, max_new in ((long_future, 2000), (short_future, 6)):
        s.tokens = list(range(60))
        s.max_new_tokens = max_new
    planner = Planner(TARGET, costly_prefill, PlannerSettings(prior_alpha=0.9), clock=still)
    assert planner.plan(round_inputs([long_future], {"long": 4}, {"long": True})).ks["long"] > 0
    assert planner.plan(round_inputs([short_future], {"short": 4}, {"short": True})).ks["short"] == 0


def test_a_catch_up_is_spread_over_the_rounds_left_at_the_k_planned() -> None:
    # A near-perfect draft at K = 8 emits ~8 tokens a round, so 64 tokens left are ~8 rounds:
    # a 60-step catch-up costs 7.5 steps a round there, which no gain of drafting repays. Spread
    # over the ~22 rounds that K = 2 would take (capped at 16), it looked affordable.
    long_prompt = [*draft_costs(0.23), ForwardCost(1, 1000, 0.040 * 60)]
    late = seq("late")
    late.tokens, late.max_new_tokens = list(range(1000)), 64
    planner = Planner(TARGET, long_prompt, PlannerSettings(prior_alpha=0.975), clock=still)
    assert planner.plan(round_inputs([late], {"late": 8}, {"late": True})).ks["late"] == 0
    late.max_new_tokens = 1000  # a long future repays the same catch-up
    assert planner.plan(round_inputs([late], {"late": 8}, {"late": True})).ks["late"] == 8


def test_a_kv_handoff_replaces_a_catch_up_the_draft_could_not_repay() -> None:
    """The same 60-step catch-up as above, where the target's cache can fill the draft's: the
    round copies it instead (priced as handoffs measured) and drafts at once; the Propose then
    feeds one token, so the round is no catch-up for the draft's scale."""
    long_prompt = [*draft_costs(0.23), ForwardCost(1, 1000, 0.040 * 60)]
    late = seq("late")
    late.tokens, late.max_new_tokens = list(range(1000)), 64
    planner = Planner(TARGET, long_prompt, PlannerSettings(prior_alpha=0.975), kv_handoff=KVHandoff(30, torch.bfloat16),
                      clock=still)
    plan = planner.plan(round_inputs([late], {"late": 8}, {"late": True}))
    assert plan.ks["late"] == 8 and plan.handoffs == {"late"}
    assert not plan.catching_up and plan.feeds["late"] == 1
    catch_up = planner.catch_ups.catch_up(late, planner.costs.cost_model())
    assert catch_up.extra_s == pytest.approx(HandoffCost().seconds(999))
    zero = Timed(None, 0.0, 0.0)
    report = RoundReport(plan.ks, {"late": 8}, zero, zero, 0.0, 1.0, handoffs={"late": (999, 2.0)})
    planner.observe(plan, [late], report)
    # Slower than the prior: priced higher.
    assert planner.catch_ups.handoff_cost.seconds(999) > HandoffCost().seconds(999)
    planner.kv_handoff = None  # e.g. the draft came back as another model
    assert planner.plan(round_inputs([late], {"late": 8}, {"late": True})).ks["late"] == 0


def test_a_lag_the_draft_feeds_cheaper_than_a_handoff_is_fed() -> None:
    """A few tokens behind (a lookup's round), the draft's own first forward costs less than a
    handoff's two calls: it feeds them; far behind, the handoff is the cheaper."""
    draft = [ForwardCost(1, t, 0.010 + 0.0005 * (t - 1)) for t in (1, 5, 9, 17)] + [ForwardCost(1, 64, 0.080)]
    planner = Planner(TARGET, draft, PlannerSettings(prior_alpha=0.95), kv_handoff=KVHandoff(30, torch.bfloat16),
                      clock=still)
    near, far = seq("near"), seq("far")
    near.tokens, far.tokens = list(range(40)), list(range(400))
    near.draft_valid, far.draft_valid = 30, 0
    plan = planner.plan(round_inputs([near, far], {"near": 8, "far": 8}, {"near": False, "far": False}))
    assert plan.handoffs == {"far"} and plan.catching_up
    uncosted = Planner(TARGET, [], kv_handoff=KVHandoff(30, torch.bfloat16), clock=still)  # a fixed K: nothing to weigh
    plan = uncosted.plan(round_inputs([near, far], {"near": 8, "far": 8}, {"near": False, "far": False}))
    assert plan.handoffs == {"near", "far"}


def test_the_handoff_cost_fits_a_calls_part_and_a_tokens() -> None:
    cost = HandoffCost(call_s=0.0, token_s=0.0, weight=0.2)
    for tokens in (40, 128, 512, 1660, 40, 128, 512, 1660):
        cost.observe(tokens, 0.015 + 1.1e-4 * tokens)
    assert cost.call_s == pytest.approx(0.015) and cost.token_s == pytest.approx(1.1e-4)
    same = HandoffCost(call_s=0.0, token_s=1e-4)
    for _ in range(3):  # one size only says nothing of the part per token: the fixed part moves
        same.observe(100, 0.03)
    assert same.token_s == 1e-4 and same.seconds(100) == pytest.approx(0.03)


def test_a_prompt_catch_up_is_priced_at_the_context_the_draft_holds() -> None:
    # Costs shaped like the embedded pair's: a draft step a quarter of the target's, a 64-token
    # chunk six steps, and attention reading ~5 µs (draft) and ~2 µs (target) a cached token at
    # 1 token, ~20 µs at 17. The request's 1,658 cached tokens are what its rounds will read,
    # but its catch-up reads only itself: priced at the batch's context, the 1,658-token chunk
    # came out at ~5 s (against ~1 s measured) and the draft never caught up.
    target = [ForwardCost(1, t, 0.043 + 0.0019 * (t - 1), context=48) for t in (1, 5, 9, 17)] + [
        ForwardCost(1, 1, 0.043 + 256 * 2e-6, context=304), ForwardCost(1, 17, 0.073 + 256 * 7e-6, context=304)]
    draft = [ForwardCost(1, t, s, context=48)
             for t, s in ((1, 0.011), (5, 0.023), (9, 0.032), (17, 0.050), (64, 0.065))] + [
        ForwardCost(1, 1, 0.011 + 256 * 5e-6, context=304), ForwardCost(1, 17, 0.050 + 256 * 21e-6, context=304)]
    long = seq("long")
    long.tokens, long.max_new_tokens, long.completion_tokens = list(range(1659)), 128, 1
    planner = Planner(target, draft, PlannerSettings(prior_alpha=0.92), clock=still)
    catch_up = planner.catch_ups.catch_up(long, planner.costs.cost_model(1659))
    assert 0.3 < catch_up.extra_s < 1.0  # the prompt-sized point's line, no context term
    assert planner.plan(round_inputs([long], {"long": 16}, {"long": True})).ks["long"] >= 4


def test_a_request_that_may_look_up_rents_before_it_buys_a_long_catch_up() -> None:
    """Ski rental: the catch-up of a 1,000-token prompt (~30 plain rounds here) waits while the
    request may look up, until waiting has cost as much: each plain round costs the time past
    its token at the caught-up draft's rate. Then the planner prices it as before. A model-only
    request, and a chat-sized catch-up, never wait."""
    long_prompt = [*draft_costs(0.23), ForwardCost(1, 1000, 0.040 * 30)]
    planner = Planner(TARGET, long_prompt, PlannerSettings(prior_alpha=0.975), clock=still)
    rented, model_only, chat = seq("rented"), seq("model_only"), seq("chat")
    for s in (rented, model_only):
        s.tokens, s.max_new_tokens = list(range(1000)), 1000
    chat.max_new_tokens = 1000
    model = planner.costs.cost_model(1000)
    plain_round = model.round_seconds([0])

    def plan(s: Request) -> int:
        """Plan `s` alone; a plain round takes as long as predicted."""
        lookup_allowed = () if s is model_only else (s.slot_id,)
        plan = planner.plan(round_inputs([s], {s.slot_id: 8}, {s.slot_id: True}, lookup_allowed=lookup_allowed))
        if plan.ks[s.slot_id] == 0:
            verify = Timed(None, plain_round, plain_round)
            planner.observe(plan, [s], RoundReport(plan.ks, {s.slot_id: 0}, Timed(None, 0.0, 0.0), verify, 0.0,
                                                   plain_round))
        return plan.ks[s.slot_id]

    assert plan(model_only) == 8 and plan(chat) == 8
    extra = planner.catch_ups.catch_up(rented, model).extra_s
    caught_up = max(model.tokens_per_second([k], [planner.acceptance.alphas(rented)], [0.0], [1]) for k in range(1, 9))
    forgone = plain_round - 1 / caught_up  # a plain round's token, had the draft been caught up
    waits = 0
    while plan(rented) == 0:
        waits += 1
        assert waits < 200
    assert extra / forgone > 40 and waits == pytest.approx(extra / forgone, abs=1)
    planner.forget(rented)  # a new request under the same slot rents afresh
    assert plan(rented) == 0


def test_a_catch_up_slower_than_its_price_is_priced_higher_next_time() -> None:
    # The table prices a 1,000-token catch-up from its 64-token point on; the Propose that ran
    # it took three times that part more than its steps: the next catch-up costs that, while one
    # within the widest measured chunk keeps the table's price. Each length class keeps its own
    # correction (a chat prompt's catch-up says little of a long one's); a class not measured
    # yet takes the nearest measured one's.
    draft = [*draft_costs(0.25), ForwardCost(1, 64, 0.040 * 0.25 * 6)]
    planner = Planner(TARGET, draft, PlannerSettings(prior_alpha=0.95), clock=still)
    first, short, shorter = seq("first"), seq("short"), seq("shorter")
    first.tokens, first.max_new_tokens, short.tokens = list(range(1000)), 1000, list(range(60))
    shorter.tokens, shorter.max_new_tokens = list(range(200)), 1000

    def price(s: Request) -> float:
        return planner.catch_ups.seconds(s)

    def run(s: Request, times_beyond: float) -> RoundPlan:
        """Plan `s` alone and report its catch-up as `times_beyond` × its part past the table."""
        plan = planner.plan(round_inputs([s], {s.slot_id: 2}, {s.slot_id: True}))
        assert plan.ks[s.slot_id] == 2 and plan.catching_up and 0 < plan.catch_up_beyond_s < plan.catch_up_s
        steps = planner.costs.cost_model().draft_seconds([2], [1])
        took = steps + plan.catch_up_s + (times_beyond - 1) * plan.catch_up_beyond_s
        planner.observe(plan, [s], RoundReport(plan.ks, {s.slot_id: 2}, Timed(None, took, 0.0),
                                               Timed(None, 0.05, 0.0), 0.0, 0.0))
        return plan

    before, short_before = price(first), price(short)
    plan = run(first, times_beyond=3)
    assert plan.catch_up_s == pytest.approx(before) and plan.catch_up_tokens == 1000
    assert price(first) == pytest.approx(before + 2 * plan.catch_up_beyond_s)
    assert price(short) == pytest.approx(short_before)
    within, beyond = catch_up_forward(shorter, planner.costs.cost_model().draft)
    assert price(shorter) == pytest.approx(within + 3 * beyond)  # not measured: the nearest class's x3
    run(shorter, times_beyond=0.5)  # its own class measures cheaper: the long class keeps its correction
    assert price(shorter) == pytest.approx(within + 0.5 * beyond)
    assert price(first) == pytest.approx(before + 2 * plan.catch_up_beyond_s)
    planner.set_costs("draft", draft)  # a restarted draft: measured afresh
    assert price(first) == pytest.approx(before)


def test_steps_faster_than_the_table_do_not_cheapen_a_catch_up() -> None:
    """Compiled steps loaded after start-up run faster than the table measured them; a
    catch-up runs eager, as the table's wide chunks did, so its price stays the table's."""
    draft = [*draft_costs(0.25), ForwardCost(1, 64, 0.040 * 0.25 * 6)]
    planner = Planner(TARGET, draft, PlannerSettings(prior_alpha=0.95), clock=still)
    warm, long = seq("warm"), seq("long")
    long.tokens, warm.draft_valid = list(range(1000)), len(warm.tokens) - 1  # the draft saw warm's prompt
    before = planner.catch_ups.seconds(long)
    for _ in range(20):
        plan = planner.plan(round_inputs([warm], {"warm": 4}, {"warm": True}))
        assert plan.ks["warm"] > 0 and not plan.catching_up
        half = 0.5 * planner.costs.cost_model().draft_seconds([plan.ks["warm"]], [1])
        planner.observe(plan, [warm], RoundReport(plan.ks, {"warm": plan.ks["warm"]}, Timed(None, half, 0.0),
                                                  Timed(None, 0.05, 0.0), 0.0, 0.0))
        warm.tokens.extend([7] * (plan.ks["warm"] + 1))
        warm.draft_valid = len(warm.tokens) - 1
    fresh = Planner(TARGET, draft, clock=still)
    assert planner.costs.cost_model().draft.step(1) < 0.7 * fresh.costs.cost_model().draft.step(1)
    assert planner.catch_ups.seconds(long) == pytest.approx(before)


def test_the_first_probe_ignores_the_budget_so_a_good_draft_is_found() -> None:
    # A 60-token catch-up costing ~50 steps is over any probe budget a few rounds earn, and the
    # pessimistic prior keeps K at 0. The source's first probe still goes ahead once its wait
    # has passed; afterwards the budget holds again.
    costly_prefill = [*draft_costs(0.3), ForwardCost(1, 9, 0.040 * 0.3 * 8)]
    fresh = seq("fresh")
    fresh.tokens = list(range(60))
    planner = Planner(TARGET, costly_prefill, PlannerSettings(prior_alpha=0.5), clock=still)
    history = [planner.plan(round_inputs([fresh], {"fresh": 4}, {"fresh": True})).ks["fresh"]
               for _ in range(FIRST_PROBE_ROUNDS)]
    assert history[:-1] == [0] * (FIRST_PROBE_ROUNDS - 1) and history[-1] > 0  # probed once its wait passed

    zero = Timed(None, 0.0, 0.0)
    planner.observe(RoundPlan({"fresh": history[-1]}), [fresh],
                    RoundReport({"fresh": history[-1]}, {"fresh": 0}, zero, zero, 0.0, 0.0))
    later = [planner.plan(round_inputs([fresh], {"fresh": 4}, {"fresh": True})).ks["fresh"] for _ in range(200)]
    assert later[1:] == [0] * 199  # the probe's second round aside: over budget, so no probe


def test_no_probe_where_even_a_perfect_draft_would_not_pay() -> None:
    # A compute-bound target (each verified token costs the same at any batch size) and a
    # draft at c = 0.4: alone a request gains from speculating, in a batch of 16 none does,
    # however well its draft is accepted. No request is probed on its own there (it would only
    # pay catch-ups); the source's scheduled probe, which asks no estimate, is the one exception.
    compute_bound = [ForwardCost(b, t, 0.040 + 0.006 * b * t) for b in (1, 4, 16) for t in (1, 5, 9)]
    drafts = [ForwardCost(b, 1, 0.012 + 0.006 * b) for b in (1, 4, 16)]
    crowd = [seq(f"r{i}") for i in range(16)]
    planner = Planner(compute_bound, drafts, PlannerSettings(probe_every=4), clock=still)
    drafted = 0
    for _ in range(60):
        ks = feed(planner, crowd, {s.slot_id: 1.0 for s in crowd}, rounds=1).ks
        drafted += sum(k > 0 for k in ks.values())
    assert drafted <= MODEL_PROBE_ROUNDS
    alone = seq("alone")
    assert feed(planner, [alone], {"alone": 1.0}, rounds=1).ks["alone"] > 0


def test_a_request_not_worth_probing_is_asked_again_after_as_many_rounds_as_the_batch_has(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Same crowd as above: no probe could pay. Asking each due request every round cost ~8 ms
    # of planning per round at 16 requests (a dozen rate predictions per question), about a
    # tenth of a batch-16 round; about one question per round is enough.
    compute_bound = [ForwardCost(b, t, 0.040 + 0.006 * b * t) for b in (1, 4, 16) for t in (1, 5, 9)]
    drafts = [ForwardCost(b, 1, 0.012 + 0.006 * b) for b in (1, 4, 16)]
    crowd = [seq(f"r{i}") for i in range(16)]
    asked: list[str] = []
    could_pay = RatePredictor.probe_could_pay

    def counting(self: RatePredictor, s: Request, ks: dict[str, int], caps: dict[str, int], *args: Any) -> bool:
        asked.append(s.slot_id)
        return could_pay(self, s, ks, caps, *args)

    monkeypatch.setattr(RatePredictor, "probe_could_pay", counting)
    planner = Planner(compute_bound, drafts, PlannerSettings(probe_every=32), clock=still)
    feed(planner, crowd, {s.slot_id: 1.0 for s in crowd}, rounds=80)
    # While the source is off, its own probes explore it, and no request is asked at all.
    assert all(asked.count(s.slot_id) <= 4 for s in crowd)


def test_a_batch_shares_one_probe_budget() -> None:
    # Catching up on 15 tokens costs ~0.17 s: 70 % of one request's probe budget (5 % of 100
    # plain rounds at batch 4), but a catch-up stalls all four streams, each of which would
    # probe in turn, so together they would spend 280 % of it.
    costly_prefill = [*draft_costs(0.1), ForwardCost(1, 9, 0.040 * 0.3 * 8)]
    seqs = [seq(f"r{i}") for i in range(4)]
    for s in seqs:
        s.tokens = list(range(15))
    planner = Planner(TARGET, costly_prefill, PlannerSettings(probe_every=4), clock=still)
    probes = 0
    for round_index in range(60):
        ks = feed(planner, seqs, {s.slot_id: 0.0 for s in seqs}, rounds=1).ks
        if round_index > 8:  # the optimistic prior has been corrected: every request is off
            probes += sum(k > 0 for k in ks.values())
    assert probes <= MODEL_PROBE_ROUNDS  # the source's first probe, which no budget holds back; no request's own


def test_the_overhead_a_draft_token_adds_keeps_a_cheap_weak_draft_off() -> None:
    # A nearly free draft accepted 10 % of the time: by the forward costs alone one draft
    # token pays (1.1 tokens for a 2-token verify that costs about one step). But every
    # draft token adds 15 ms of RPC and acceptance to the round, which the planner learns.
    settings = PlannerSettings(prior_alpha=0.1, request_weight=0.0, global_weight=0.0, probe_every=1000,
                               max_probe_every=1000)
    planner = Planner(TARGET, draft_costs(0.02), settings, clock=still)
    a = seq("a")
    zero = Timed(None, 0.0, 0.0)
    assert planner.plan(round_inputs([a], {"a": 8}, {"a": True})).ks["a"] > 0
    for k in (0, 1, 0, 1, 0, 1) * 10:
        report = RoundReport({"a": k}, {"a": 0}, zero, zero, 0.0, 0.002 + 0.015 * k)
        planner.observe(RoundPlan(report.ks), [a], report)
    assert planner.costs.draft_overhead.per_token == pytest.approx(0.015, rel=0.05)
    assert planner.plan(round_inputs([a], {"a": 8}, {"a": True})).ks["a"] == 0


@pytest.mark.parametrize("reported", [True, False])
def test_a_calls_wait_at_a_shared_service_is_not_learnt_as_the_cost_of_drafting(reported: bool) -> None:
    # Rounds that draft wait 50 ms a draft token longer, all of it at the target, held for
    # another gateway's Verify (`VerifyResponse.queued_s`). That wait comes of the other
    # gateway's timing, not of K: learnt as draft overhead it would keep this gateway's draft
    # off, as an unreported wait does.
    settings = PlannerSettings(prior_alpha=0.6, request_weight=0.0, global_weight=0.0, probe_every=1000,
                               max_probe_every=1000)
    planner = Planner(TARGET, draft_costs(0.02), settings, clock=still)
    a = seq("a")
    for k in (0, 1, 0, 1, 0, 1) * 10:
        queued_s = 0.05 * k
        verify = Timed(None, 0.0, queued_s, None, 0, queued_s if reported else 0.0)
        report = RoundReport({"a": k}, {"a": k}, Timed(None, 0.0, 0.0), verify, 0.0, 0.002 + queued_s)
        planner.observe(RoundPlan(report.ks), [a], report)
    assert planner.costs.draft_overhead.per_token == pytest.approx(0.0 if reported else 0.05, abs=0.002)
    assert (planner.plan(round_inputs([a], {"a": 8}, {"a": True})).ks["a"] > 0) == reported


def test_the_draft_overhead_splits_into_a_fixed_and_a_per_token_part() -> None:
    overhead = DraftOverhead(weight=0.1)
    overhead.observe(4, 0.008)  # a single total: all of it per token until Σk varies
    assert (overhead.per_round, overhead.per_token) == (0.0, pytest.approx(0.002))
    for drafted in (2, 4, 8, 3, 16, 5) * 20:  # a 4 ms Propose plus 1 ms per draft token
        overhead.observe(drafted, 0.004 + 0.001 * drafted)
    assert overhead.per_round == pytest.approx(0.004, rel=0.05)
    assert overhead.per_token == pytest.approx(0.001, rel=0.05)


def test_a_two_token_feed_is_not_mistaken_for_dearer_draft_steps() -> None:
    # After a fully accepted round the draft's first step takes 2 tokens (the last draft
    # token and the bonus token), here at 1.8 one-token steps. A Propose that cost exactly
    # that leaves the draft's cost scale at 1.
    step = 0.040 * 0.3
    planner = Planner(TARGET, [*draft_costs(0.3), ForwardCost(1, 2, 1.8 * step)], PlannerSettings(cost_weight=0.5),
                      clock=still)
    a = seq("a")
    a.draft_valid = len(a.tokens) - 2
    assert a.draft_pending == 2
    plan = planner.plan(round_inputs([a], {"a": 4}, {"a": True}))
    ks = plan.ks
    k = ks["a"]
    assert k > 0
    propose_s = 1.8 * step + (k - 1) * step
    verify_s = planner.costs.cost_model().target.seconds(1, k + 1)
    for _ in range(10):
        planner.observe(plan, [a], RoundReport(ks, {"a": k}, Timed(None, propose_s, propose_s),
                                               Timed(None, verify_s, verify_s), 0.0, 0.0))
    model = planner.costs.cost_model()
    assert model.draft is not None and model.draft.step(1) == pytest.approx(step, rel=1e-3)


def with_context_slope(costs: list[ForwardCost], per_token_s: float) -> list[ForwardCost]:
    """`costs` measured at 48 tokens of context, plus their 1-token points again at 304,
    `per_token_s` dearer per cached token and request."""
    short = [dataclasses.replace(c, context=48) for c in costs]
    return short + [dataclasses.replace(c, context=304, seconds=c.seconds + c.batch_size * 256 * per_token_s)
                    for c in short if c.tokens == 1]


def test_a_long_context_can_make_drafting_stop_paying() -> None:
    # A draft whose step grows with the context much faster than the target's (its attention
    # is the slow part): worth drafting for at 50 tokens of context, not at 1000.
    planner = Planner(with_context_slope(TARGET, 2e-6), with_context_slope(draft_costs(0.15), 40e-6), clock=still)
    seqs = [seq(f"r{i}") for i in range(4)]
    assert set(feed(planner, seqs, {s.slot_id: 0.8 for s in seqs}, rounds=5).ks.values()) != {0}
    for s in seqs:
        s.tokens = list(range(1000))
        s.draft_valid = 999
    assert set(feed(planner, seqs, {s.slot_id: 0.8 for s in seqs}, rounds=1).ks.values()) == {0}


def test_the_online_scale_does_not_chase_a_growing_context() -> None:
    # Rounds whose compute is exactly what the tables say at each round's context leave
    # both scales at 1, however long the contexts grow.
    target, draft = with_context_slope(TARGET, 10e-6), with_context_slope(draft_costs(0.15), 10e-6)
    planner = Planner(target, draft, clock=still)
    seqs = [seq(f"r{i}") for i in range(4)]
    for length in range(50, 400, 50):
        for s in seqs:
            s.tokens, s.draft_valid = list(range(length)), length - 1
        plan = planner.plan(round_inputs(seqs, {s.slot_id: 4 for s in seqs}, {s.slot_id: False for s in seqs}))
        ks = plan.ks
        truth = planner.costs.cost_model(context=length)  # scales are still 1: the tables at this context
        kk = [ks[s.slot_id] for s in seqs]
        report = RoundReport(ks, {s.slot_id: 4 for s in seqs}, Timed(None, truth.draft_seconds(kk), 0.0),
                             Timed(None, truth.verify_seconds(kk), 0.0), 0.0, 0.0)
        planner.observe(plan, seqs, report)
        assert planner.costs.cost_model(context=length).draft.scale == pytest.approx(1.0)  # type: ignore[union-attr]
        assert planner.costs.cost_model(context=length).target.scale == pytest.approx(1.0)


def test_the_search_for_k_stops_past_the_peak_but_not_at_a_catch_up_dip() -> None:
    """The best uniform K is searched up to `SEARCH_PATIENCE` past the best drafting K: a draft
    that never pays costs four predictions a round, not seventeen; one whose catch-up puts K = 1-3
    below plain still finds K = 8 above it."""
    from types import SimpleNamespace

    from specdec.gateway.planner.choice import SEARCH_PATIENCE, best_model_k
    from specdec.gateway.planner.rates import SourceChoice

    def search(curve: list[float]) -> tuple[int, int]:
        tried: list[int] = []

        def rate(ks: dict[str, int], on_lookup: object, plain_steps: object) -> float:
            tried.append(ks["s"])
            return curve[ks["s"]]

        rates = SimpleNamespace(rate=rate, seqs=[seq("s")], alphas=[[0.5]])
        choice = SourceChoice({"s": 0})
        best_model_k(rates, choice, [seq("s")], {"s": 16}, None)  # type: ignore[arg-type]
        return choice.ks["s"], len(tried)

    never_pays = [10.0] + [9.0 - k / 10 for k in range(1, 17)]
    assert search(never_pays) == (0, 2 + SEARCH_PATIENCE)
    dip_then_peak = [10.0, 6.0, 7.0, 8.0, 9.0, 10.5, 11.0, 11.5, 12.0, 11.8, 11.6, 11.4, 11.2, 11.0, 10.8, 10.6, 10.4]
    assert search(dip_then_peak) == (8, 9 + SEARCH_PATIENCE)
