"""The planner's choice of draft source per request (lookup, model draft, plain), with
synthetic costs and acceptance: no services, no models."""

from __future__ import annotations

import pytest
import torch

from specdec.cost_model import CostTable, ForwardCost, RoundCostModel
from specdec.gateway.draft_sources import DraftSource
from specdec.gateway.model_clients import Timed
from specdec.gateway.planner import Planner, PlannerSettings
from specdec.gateway.planner.rates import lookup_length
from specdec.gateway.proposers import LookupDraft
from specdec.gateway.request import Request
from specdec.gateway.rounds import RoundPlan, RoundReport
from tests.support.planner_rounds import round_inputs, still
from tests.unit.gateway.test_k_planner import TARGET, draft_costs, seq

ZERO = Timed(None, 0.0, 0.0)


def copy(n: int = 8, match_len: int = 4, source: DraftSource = DraftSource.PROMPT_LOOKUP) -> LookupDraft:
    return LookupDraft(tuple(range(100, 100 + n)), source, match_len)


def run_rounds(planner: Planner, seqs: list[Request], lookups: dict[str, LookupDraft], alpha: dict[str, float],
               rounds: int, lookup_alpha: dict[str, float] | None = None, timed: bool = False,
               **plan_options: object) -> RoundPlan:
    """Plan and observe `rounds` rounds in which request r's model draft agrees with the target
    on each token with probability alpha[r], and its lookup with lookup_alpha[r] (default the
    same): the target's text goes on as the lookup proposes for a geometric number of tokens,
    and each request emits what its round accepted plus one token. Rounds take no time, or
    where `timed` as long as the planner predicts. Returns the last plan."""
    rng = torch.Generator().manual_seed(0)
    lookup_alpha = lookup_alpha or alpha
    plan = RoundPlan({})

    def agreeing(p: float) -> int:
        return int((torch.rand(8, generator=rng) < p).long().cumprod(0).sum())

    for _ in range(rounds):
        plan = planner.plan(round_inputs(seqs, {s.slot_id: 8 for s in seqs}, {s.slot_id: True for s in seqs},
                            lookups=lookups, **plan_options))  # type: ignore[arg-type]
        accepted = {}
        for s in seqs:
            slot = s.slot_id
            proposed = list(lookups[slot].tokens) if slot in lookups else []
            truth = proposed[: agreeing(lookup_alpha[slot])] + [999] * 9
            agrees = agreeing(alpha[slot]) if slot not in plan.lookups else len(truth) - 9
            accepted[slot] = min(agrees, plan.ks[slot])
            s.tokens.extend(truth[: accepted[slot] + 1])
            if plan.model_ks[slot]:  # the draft saw all but the round's last token
                s.draft_valid = len(s.tokens) - 1
        propose, verify = predicted_times(planner, plan, seqs) if timed else (ZERO, ZERO)
        planner.observe(plan, seqs, RoundReport(plan.ks, accepted, propose, verify, 0.0,
                                                propose.wall_s + verify.wall_s))
    return plan


def predicted_times(planner: Planner, plan: RoundPlan, seqs: list[Request]) -> tuple[Timed[None], Timed[None]]:
    """Propose and Verify of `plan` taking what the planner predicts (wall = compute)."""
    model = planner.costs.cost_model(plan.context)
    ks = [plan.ks[s.slot_id] for s in seqs]
    verify = model.verify_seconds(ks)
    draft = model.round_seconds(ks, lookup=[s.slot_id in plan.lookups for s in seqs]) - verify
    return Timed(None, draft, draft), Timed(None, verify, verify)


def test_a_lookup_that_copies_beats_the_model_draft() -> None:
    # Copy-heavy text: both sources are always right, but the lookup costs no draft steps.
    planner = Planner(TARGET, draft_costs(0.2), clock=still)
    a = seq("a")
    plan = run_rounds(planner, [a], {"a": copy()}, {"a": 1.0}, rounds=10)
    assert plan.ks["a"] == 8 and plan.source_of("a") is DraftSource.PROMPT_LOOKUP
    assert plan.model_ks == {"a": 0} and plan.lookups["a"].tokens == copy().tokens


def test_a_lookup_that_misses_leaves_the_model_draft_in_place() -> None:
    planner = Planner(TARGET, draft_costs(0.1), clock=still)
    a = seq("a")
    # Lookups of this kind are rarely right; the model draft is. Both α are learned on the way,
    # the lookup's from the rounds that did not verify it too.
    plan = run_rounds(planner, [a], {"a": copy(match_len=1)}, {"a": 0.95}, rounds=40, lookup_alpha={"a": 0.05})
    assert plan.source_of("a") is DraftSource.MODEL and plan.ks["a"] >= 5


def test_acceptance_is_learned_per_lookup_kind_not_per_request_model_draft() -> None:
    planner = Planner(TARGET, draft_costs(0.1), clock=still)
    a = seq("a")
    suffix = copy(n=4, match_len=2, source=DraftSource.SUFFIX)
    plan = RoundPlan({"a": 4}, lookups={"a": suffix})
    planner.observe(plan, [a], RoundReport({"a": 4}, {"a": 0}, ZERO, ZERO, 0.0, 0.01))
    assert planner.lookups.estimate(suffix).alpha < planner.settings.lookup_prior_alpha
    assert planner.lookups.estimate(copy(match_len=2)).alpha == planner.settings.lookup_prior_alpha  # another source
    assert planner.acceptance.alphas(a) == [planner.settings.prior_alpha]  # the model draft's estimate is untouched
    assert planner.costs.lookup_token_overhead_s == pytest.approx(planner.settings.cost_weight * 0.01 / 4)


def test_a_lookup_passed_over_is_judged_against_the_emitted_tokens() -> None:
    planner = Planner(TARGET, draft_costs(0.1), clock=still)
    a = seq("a")
    proposal = copy(n=4, match_len=3)
    plan = RoundPlan({"a": 0}, offered={"a": (len(a.tokens), proposal)})
    a.tokens += [100, 101, 7]  # the round emitted two of the proposal's tokens, then another
    planner.observe(plan, [a], RoundReport({"a": 0}, {"a": 0}, ZERO, ZERO, 0.0, 0.0))
    # Token 1 matched 3 tokens (accepted); tokens 2 and 3 matched 4 and 5, one class (accepted, rejected).
    first, later = planner.lookups.estimate(proposal), planner.lookups.estimate(proposal, 1)
    assert first.seen == 1 and first.alpha == pytest.approx((0.5 + 1) / 2)
    assert later.seen == 2 and later.alpha == pytest.approx((0.5 + 1 + 0) / 3)
    b = seq("b")
    plan = RoundPlan({"b": 0}, offered={"b": (len(b.tokens), proposal)})
    b.tokens += [100]  # one token emitted, and it agreed: one outcome, accepted
    planner.observe(plan, [b], RoundReport({"b": 0}, {"b": 0}, ZERO, ZERO, 0.0, 0.0))
    assert first.seen == 2 and later.seen == 2


def test_without_a_draft_model_lookups_are_priced_against_plain_decoding() -> None:
    planner = Planner(TARGET, [], uses_draft=False, clock=still)
    assert planner.can_adapt
    a, b = seq("a"), seq("b")
    plan = run_rounds(planner, [a, b], {"a": copy(), "b": copy(match_len=1)}, {"a": 1.0, "b": 0.0}, rounds=30,
                      model_allowed=set())
    assert plan.source_of("a") is DraftSource.PROMPT_LOOKUP and plan.ks["a"] == 8
    # Its 1-token matches were never right: at most a token of them is worth a verify slot.
    assert plan.ks["b"] <= 1 and plan.model_ks == {"a": 0, "b": 0}


def test_a_lookup_is_cut_to_the_tokens_that_pay() -> None:
    assert lookup_length([1.0], 8, 0.05) == 8
    assert lookup_length([0.5], 8, 0.1) == 3  # 0.5, 0.25, 0.125 > 0.1; 0.0625 is not
    assert lookup_length([0.0], 8, 0.01) == 0
    assert lookup_length([0.5, 0.9, 1.0], 8, 0.3) == 8  # 0.5, 0.45, then every token is kept
    planner = Planner(TARGET, [], uses_draft=False, clock=still)
    planner.lookups.estimate(copy()).alpha = 0.5
    plan = planner.plan(round_inputs([seq("a")], {"a": 8}, {"a": True}, lookups={"a": copy()}, model_allowed=set()))
    assert 1 <= plan.ks["a"] < 8 and len(plan.lookups["a"].tokens) == plan.ks["a"]


def test_a_lookup_grows_more_certain_as_its_match_grows() -> None:
    # Lookups matching 1 token are wrong at their first token, and right from the second on
    # (a copy that got going): the first token's estimate falls, the later ones' rise.
    planner = Planner(TARGET, [], uses_draft=False, clock=still)
    weak = copy(n=8, match_len=1)
    for accepted in (0, 0, 0, 8, 8):
        planner.observe(RoundPlan({"a": 8}, lookups={"a": weak}), [seq("a")],
                        RoundReport({"a": 8}, {"a": accepted}, ZERO, ZERO, 0.0, 0.0))
    alphas = planner.lookups.alphas(weak)
    assert len(alphas) == 8 and alphas[0] < planner.settings.lookup_prior_alpha < alphas[1] and alphas[3] == alphas[6]
    assert planner.lookups.alphas(copy(n=8, match_len=8)) == [planner.lookups.estimate(weak, 7).alpha]  # one class
    assert planner.lookups.estimate(weak, 7) is planner.lookups.estimate(copy(match_len=8))  # lengths 4-7, 8-15, ...


def test_fixed_requests_take_a_lookup_that_fills_their_k_or_when_the_model_may_not_draft_else_guess_it() -> None:
    planner = Planner(TARGET, draft_costs(0.1), clock=still)
    seqs = [seq("full"), seq("short"), seq("ngram")]
    caps = {s.slot_id: 4 for s in seqs}
    lookups = {"full": copy(n=6), "short": copy(n=2), "ngram": copy(n=2)}
    plan = planner.plan(round_inputs(seqs, caps, dict.fromkeys(caps, False), lookups=lookups,
                                     model_allowed={"full", "short"}))
    assert plan.ks == {"full": 4, "short": 4, "ngram": 2}
    assert {slot: plan.source_of(slot) for slot in caps} == {
        "full": DraftSource.PROMPT_LOOKUP, "short": DraftSource.LOOKUP_THEN_MODEL, "ngram": DraftSource.PROMPT_LOOKUP}
    assert plan.lookups["full"].tokens == copy(n=4).tokens
    # Without its costs weighed, the model draft gets the whole short lookup as its guess.
    assert plan.guesses == {"short": copy(n=2)} and plan.model_ks == {"full": 0, "short": 4, "ngram": 0}


def test_a_request_may_not_use_the_model_draft_when_it_is_not_allowed() -> None:
    planner = Planner(TARGET, draft_costs(0.1), clock=still)
    plan = run_rounds(planner, [seq("a")], {}, {"a": 0.95}, rounds=3, model_allowed=set())
    assert plan.ks == {"a": 0} and not plan.drafts


def wide_draft_costs(c: float, token_share: float = 0.15) -> list[ForwardCost]:
    """A draft at `c` target steps a step, each further token of a forward adding
    `token_share` of a step (a CPU draft: wider forwards cost little more than a step)."""
    return [ForwardCost(b, t, 0.040 * c * (1 + 0.05 * (b - 1)) * (1 + token_share * (t - 1)))
            for b in (1, 4, 16) for t in (1, 5, 9)]


def test_a_lookup_right_half_the_time_becomes_the_model_drafts_guess() -> None:
    # The model draft is almost always right, a lookup half the time: verifying the lookup alone
    # yields little, but as a guess each right token saves a draft step for a token of width.
    planner = Planner(TARGET, wide_draft_costs(0.25), clock=still)
    a = seq("a")
    plan = run_rounds(planner, [a], {"a": copy(match_len=2)}, {"a": 0.97}, rounds=20, lookup_alpha={"a": 0.5})
    assert plan.source_of("a") is DraftSource.LOOKUP_THEN_MODEL and plan.ks["a"] >= 5
    guess = plan.guesses["a"]
    assert 1 <= len(guess.tokens) < plan.ks["a"] and guess.tokens == copy().tokens[: len(guess.tokens)]
    assert plan.model_ks == {"a": plan.ks["a"]} and not plan.lookups


def test_a_planner_told_not_to_guess_gives_the_draft_no_lookup() -> None:
    planner = Planner(TARGET, wide_draft_costs(0.25), guesses=False, clock=still)
    plan = run_rounds(planner, [seq("a")], {"a": copy(match_len=2)}, {"a": 0.97}, rounds=20, lookup_alpha={"a": 0.5})
    assert not plan.guesses and plan.source_of("a") in (DraftSource.MODEL, DraftSource.PROMPT_LOOKUP)
    fixed = planner.plan(round_inputs([seq("b")], {"b": 4}, {"b": False}, lookups={"b": copy(n=2)}))
    assert not fixed.guesses and fixed.source_of("b") is DraftSource.MODEL


def test_no_guess_where_a_fed_token_costs_a_whole_step_or_the_draft_catches_up() -> None:
    a = seq("a")
    plan = run_rounds(Planner(TARGET, draft_costs(0.25), clock=still), [a], {"a": copy(match_len=2)}, {"a": 0.97},
                      rounds=20,
                      lookup_alpha={"a": 0.5})
    assert not plan.guesses  # its table prices every token of width as a whole step
    planner = Planner(TARGET, wide_draft_costs(0.25), clock=still)
    b = seq("b")
    b.tokens += list(range(20))  # 23 tokens the draft has not seen: a catch-up, not a round's feed
    plan = planner.plan(round_inputs([b], {"b": 8}, {"b": True}, lookups={"b": copy(match_len=2)}))
    assert not plan.guesses


def test_guessed_tokens_widen_the_drafts_first_forward_and_save_steps() -> None:
    model = RoundCostModel(CostTable(TARGET), CostTable(wide_draft_costs(0.25)))
    draft = model.draft
    assert draft is not None
    plain = model.draft_seconds([8], [1])
    assert plain == pytest.approx(draft.seconds(1, 1) + 7 * draft.step(1))
    # Seven guessed tokens, every one drawn too: one forward of 8 tokens and no step.
    assert model.draft_seconds([8], [8], [7.0]) == pytest.approx(draft.seconds(1, 8))
    # Half a step saved on average: the last step runs for the half of the rounds that need it.
    assert model.draft_seconds([8], [2], [0.5]) == pytest.approx(draft.seconds(1, 2) + 6.5 * draft.step(1))
    # A batch pads its first forward to the widest feed.
    two = model.draft_seconds([8, 8], [8, 1], [7.0, 0.0])
    assert two == pytest.approx(draft.seconds(2, 8) + 7 * draft.step(1))


def guessing_rounds(planner: Planner, a: Request, share: float, rounds: int = 20) -> RoundPlan:
    """Rounds in which request a's model draft is right at α 0.95 and the draft's own lookup
    guesses save `share` of the steps after its first forward."""
    plan = RoundPlan({})
    for _ in range(rounds):
        plan = planner.plan(round_inputs([a], {"a": 8}, {"a": True}, lookup_allowed={"a"}))
        k = plan.ks["a"]
        accepted = min(k, 6)
        a.tokens.extend([999] * (accepted + 1))
        if plan.model_ks["a"]:
            a.draft_valid = len(a.tokens) - 1
        guessed = {"a": round(share * (k - 1))} if k > 1 else {}
        fed = {"a": 2 * (k - 1)} if k > 1 else {}  # two tokens of width a step
        planner.observe(plan, [a], RoundReport(plan.ks, {"a": accepted}, ZERO, ZERO, 0.0, 0.0, guessed=guessed,
                                               own_guess_tokens=fed))
    return plan


def test_a_draft_that_guesses_on_its_own_is_priced_by_the_steps_it_saves() -> None:
    # A draft step at 0.9 target steps: drafting alone does not pay; saving 3 steps in 4 it does.
    costly = wide_draft_costs(0.9)
    alone = guessing_rounds(Planner(TARGET, costly, clock=still), seq("a"), share=0.0)
    assert alone.ks["a"] == 0
    planner = Planner(TARGET, costly, clock=still)
    a = seq("a")
    plan = guessing_rounds(planner, a, share=0.75, rounds=60)  # the source is probed after 32 rounds off
    assert plan.ks["a"] >= 4 and plan.self_guessing == {"a"}
    assert planner.acceptance.self_guess_rates(a).saved == pytest.approx(0.75, abs=0.1)
    assert planner.acceptance.self_guess_rates(a).fed == pytest.approx(2.0)
    # A new request starts from all requests' estimate.
    assert planner.acceptance.self_guess_rates(seq("new")).saved == pytest.approx(0.75, abs=0.1)
    planner.forget(a)
    not_told = Planner(TARGET, costly, guesses=False, clock=still).plan(
        round_inputs([seq("b")], {"b": 8}, {"b": True}, lookup_allowed={"b"}))
    assert not not_told.self_guessing


def test_the_drafts_own_guesses_widen_its_forwards_a_token_each() -> None:
    model = RoundCostModel(CostTable(TARGET), CostTable(wide_draft_costs(0.25)))
    draft = model.draft
    assert draft is not None
    saving = model.draft_seconds([8], [1], [4.0])
    assert model.draft_seconds([8], [1], [4.0], [6.0]) == pytest.approx(saving + 6 * draft.width_seconds())
    assert draft.width_seconds() == pytest.approx((draft.seconds(1, 9) - draft.seconds(1, 2)) / 7)


def test_a_request_whose_lookups_miss_stops_trusting_what_others_taught() -> None:
    # Lookups of one kind: request a's always copy, request b's never do. The kind's α is their
    # mix, but each request's trust scales it toward what its own lookups did.
    planner = Planner(TARGET, draft_costs(0.1), clock=still)
    a, b = seq("a"), seq("b")
    plan = run_rounds(planner, [a, b], {"a": copy(), "b": copy()}, {"a": 0.95, "b": 0.95}, rounds=30,
                      lookup_alpha={"a": 1.0, "b": 0.0})
    assert planner.lookups.trust(a) > 1.0 > 0.5 > planner.lookups.trust(b)
    assert plan.source_of("a") is DraftSource.PROMPT_LOOKUP and "b" not in plan.lookups
    kind = planner.lookups.alphas(copy())
    assert max(planner.lookups.alphas(copy(), planner.lookups.trust(b))) < min(kind)
    planner.forget(b)
    assert planner.lookups.trust(b) == 1.0


def test_a_request_whose_lookups_beat_its_caught_up_draft_never_buys_the_catch_up() -> None:
    # Renting costs the saving it forgoes: while a long prompt's lookups are right every time,
    # its model draft (α 0.95) would not be faster even caught up, so waiting costs nothing and
    # a round without a lookup decodes plainly rather than buy the 1,000-token catch-up (~15
    # plain rounds here, which charging the whole round would have paid off by now).
    planner = Planner(TARGET, [*draft_costs(0.23), ForwardCost(1, 1000, 0.040 * 15)],
                      PlannerSettings(prior_alpha=0.95), clock=still)
    a = seq("a")
    a.tokens, a.max_new_tokens = list(range(1000)), 1000
    plan = run_rounds(planner, [a], {"a": copy()}, {"a": 0.95}, rounds=30, lookup_alpha={"a": 1.0},
                      timed=True, lookup_allowed=("a",))
    assert plan.lookups["a"].tokens == copy().tokens
    assert planner.plan(round_inputs([a], {"a": 8}, {"a": True}, lookup_allowed=("a",))).ks["a"] == 0
    planner.forget(a)  # a request that may not look up has only the draft, and buys it
    assert planner.plan(round_inputs([a], {"a": 8}, {"a": True})).ks["a"] == 8
