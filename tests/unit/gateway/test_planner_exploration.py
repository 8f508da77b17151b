"""The planner's exploration and warm-up rules with synthetic costs: source states, the probe
schedule, re-measuring, and what is not learnt while a service warms up."""

from __future__ import annotations

import pytest

from specdec.gateway.draft_sources import DraftSource
from specdec.gateway.model_clients import Timed
from specdec.gateway.planner import DraftAvailability, Planner, SourceState, SwitchReason
from specdec.gateway.planner.costs import WARMUP_ROUNDS
from specdec.gateway.planner.estimates import staleness_weight
from specdec.gateway.planner.exploration import MAX_PROBE_ROUNDS
from specdec.gateway.request import Request
from specdec.gateway.rounds import RoundReport
from tests.support.planner_rounds import round_inputs, still
from tests.unit.gateway.test_k_planner import TARGET, draft_costs, seq

ROUND_S = 0.04


def caught_up(slot: str) -> Request:
    """A request whose draft has seen all but its last token, and a long way to go."""
    s = seq(slot)
    s.max_new_tokens = 100_000
    s.draft_valid = len(s.tokens) - 1
    return s


def run(planner: Planner, s: Request, rounds: int, accepted: int = 0, token_s: float = 0.004,
        draft: DraftAvailability = DraftAvailability.READY) -> list[int]:
    """Plan and observe `rounds` rounds of `s` alone, each draft accepting `accepted` tokens and
    its Propose taking `token_s` a draft token (the table's step by default); returns each round's K."""
    ks = []
    for _ in range(rounds):
        plan = planner.plan(round_inputs([s], {s.slot_id: 8}, draft=draft))
        k = plan.ks[s.slot_id]
        ks.append(k)
        verify = Timed(None, ROUND_S, ROUND_S)
        report = RoundReport(plan.ks, {s.slot_id: min(accepted, k)}, Timed(None, k * token_s, 0.0),
                             verify, 0.0, ROUND_S + k * token_s)
        planner.observe(plan, [s], report)
    return ks


def test_a_source_kept_off_by_its_acceptance_is_probed_at_a_bounded_cost() -> None:
    planner = Planner(TARGET, draft_costs(0.1), clock=still)
    a = caught_up("a")
    ks = run(planner, a, rounds=2000)  # nothing it drafts is ever accepted
    model = planner.status().of(DraftSource.MODEL)
    assert model is not None and model.state in (SourceState.OFF, SourceState.PROBING)
    assert model.reason is SwitchReason.ACCEPTANCE and model.off_s > 0
    assert planner.status().switches[(DraftSource.MODEL, SwitchReason.ACCEPTANCE)] == 1
    drafting = [i for i, k in enumerate(ks) if k > 0]
    assert sum(ks) < 0.03 * 2 * len(ks)  # probes of 2 tokens in at most ~3 % of the rounds
    late_gaps = [b - a for a, b in zip(drafting, drafting[1:]) if a > 1000]
    assert late_gaps and max(late_gaps) <= MAX_PROBE_ROUNDS + 1  # and never stop


def test_a_draft_priced_out_by_slow_first_steps_drafts_again_after_a_probe() -> None:
    planner = Planner(TARGET, draft_costs(0.1), clock=still)
    a = caught_up("a")
    step = planner.costs.cost_model().draft.step(1)  # type: ignore[union-attr]
    run(planner, a, rounds=2, accepted=8, token_s=100 * step)  # 100x what the table says
    ks = run(planner, a, rounds=200, accepted=8, token_s=step)  # off, until a probe sees the true cost
    resumed = next(i for i, k in enumerate(ks) if k > 0)
    assert 30 <= resumed <= 64 and all(k > 0 for k in ks[resumed:])
    assert planner.status().switches[(DraftSource.MODEL, SwitchReason.COST)] == 1
    assert planner.status().of(DraftSource.MODEL).state is SourceState.DRAFTING  # type: ignore[union-attr]


def test_timings_are_not_learnt_while_a_service_warms_up() -> None:
    planner = Planner(TARGET, draft_costs(0.1), clock=still)
    a = caught_up("a")
    planner.note_service("draft", pending_graphs=3)
    run(planner, a, rounds=5, accepted=8, token_s=1.0)
    assert planner.costs.draft_scale.value == 1.0  # loading graphs: not learnt
    planner.note_service("draft", pending_graphs=0)
    run(planner, a, rounds=WARMUP_ROUNDS, accepted=8, token_s=1.0)
    assert planner.costs.draft_scale.value == 1.0  # its first rounds after loading: not learnt either
    run(planner, a, rounds=1, accepted=8, token_s=1.0)
    assert planner.costs.draft_scale.value > 1.0
    planner.service_restarted("draft")  # back from a restart: measured afresh
    assert planner.costs.draft_scale.value == 1.0 and not planner.costs.warmup.steady


def test_an_unavailable_draft_is_off_for_draft_failure_until_it_drafts_again() -> None:
    planner = Planner(TARGET, draft_costs(0.1), clock=still)
    a = caught_up("a")
    plan = planner.plan(round_inputs([a], {"a": 8}, draft=DraftAvailability.DOWN))
    assert plan.ks == {"a": 0} and plan.off_reason == "draft_unavailable"
    status = planner.status().of(DraftSource.MODEL)
    assert status is not None and (status.state, status.reason) == (SourceState.OFF, SwitchReason.DRAFT_FAILURE)
    assert run(planner, a, rounds=1, accepted=8)[0] > 0
    assert planner.status().of(DraftSource.MODEL).reason is SwitchReason.PAYS  # type: ignore[union-attr]


def test_a_stale_estimate_weighs_a_new_sample_more() -> None:
    assert staleness_weight(0.0) == 0.0 and staleness_weight(10.0) == pytest.approx(0.5)
    now = [0.0]
    planner = Planner(TARGET, draft_costs(0.1), clock=lambda: now[0])
    a = caught_up("a")
    for _ in range(50):  # a well-fed estimate moves by the EMA weight
        run(planner, a, rounds=1, accepted=8)
        now[0] += ROUND_S
    step = planner.costs.cost_model().draft.step(1)  # type: ignore[union-attr]
    scale = planner.costs.draft_scale.value
    now[0] += 60.0  # a minute without samples
    plan = planner.plan(round_inputs([a], {"a": 8}))
    k = plan.ks["a"]
    report = RoundReport(plan.ks, {"a": k}, Timed(None, 2 * k * step / scale, 0.0), Timed(None, ROUND_S, ROUND_S),
                         0.0, ROUND_S)
    planner.observe(plan, [a], report)
    assert planner.costs.draft_scale.value > 1.9  # nearly the new sample's 2x, not 10 % of the way


def test_a_restarted_draft_is_probed_soon_again() -> None:
    planner = Planner(TARGET, draft_costs(0.1), clock=still)
    a = caught_up("a")
    run(planner, a, rounds=1500)
    track = planner.sources.tracks[DraftSource.MODEL]
    assert track.interval == MAX_PROBE_ROUNDS
    planner.service_restarted("draft")
    assert track.interval < MAX_PROBE_ROUNDS
