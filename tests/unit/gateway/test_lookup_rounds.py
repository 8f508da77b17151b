"""Rounds that verify lookup proposals, against fake model services: the output stays the
target's, the draft model's cache is left alone, sampled lookups carry one-hot q, and the
suffix cache reuses earlier answers. No draft service is needed for lookups."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection

import pytest

from specdec.gateway.draft_sources import DraftSource, SpeculationMethod
from specdec.gateway.planner import LOOKUP_PLAIN_STREAK, Planner
from specdec.gateway.proposers import LookupDraft, LookupProposer, LookupSettings
from specdec.gateway.request import FinishReason, Request
from specdec.gateway.scheduler import Scheduler
from specdec.v1 import common_pb2, gateway_pb2
from specdec.wire.items import SampledMode
from tests.support.fakes import FakeDraft, FakeTarget, greedy_reference, policy
from tests.support.planner_rounds import still
from tests.unit.gateway.test_k_planner import TARGET
from tests.unit.gateway.test_scheduler import drain, new_request, prompt_ids, request, run


def run_with_lookups(test: Callable[[Scheduler], Awaitable[None]], target: FakeTarget, draft: FakeDraft | None) -> None:
    run(test, target, draft, lookup=LookupProposer(LookupSettings(min_n=1, max_n=3)))


async def generate(sched: Scheduler, method: SpeculationMethod, max_new_tokens: int,
                   sampling: common_pb2.SamplingParams | None = None,
                   verification: gateway_pb2.Verification = gateway_pb2.VERIFICATION_UNSPECIFIED) -> Request:
    req = request(max_new_tokens=max_new_tokens)
    req.speculation.verification = verification
    if sampling is not None:
        req.sampling.CopyFrom(sampling)
    seq = new_request(req, policy(has_draft=sched.draft is not None, method=method))
    sched.submit(seq)
    tokens, finished = await drain(seq)
    assert finished.reason == FinishReason.LENGTH and tokens == seq.tokens[len(seq.prompt):]
    return seq


def test_lookups_without_a_draft_service_keep_the_greedy_output() -> None:
    # The toy target's text repeats every 30 tokens: after one period, lookups copy it.
    target = FakeTarget()

    async def test(sched: Scheduler) -> None:
        seq = await generate(sched, SpeculationMethod.NGRAM, 70)
        assert seq.tokens[len(seq.prompt):] == greedy_reference(prompt_ids(), 70)
        counts = seq.counts
        assert counts.lookup_rounds == counts.rounds > 0 and counts.lookup_accepted_tokens >= 30
        assert counts.rounds + counts.plain_rounds == len(target.verify_batches)

    run_with_lookups(test, target, None)
    assert target.slots == {}


class NoMatches(LookupProposer):
    """Lookups that never match: every round of a lookup-only request is plain."""

    def propose(
        self, slot_id: str, tokens: list[int], k: int, stop_token_ids: Collection[int] = ()
    ) -> LookupDraft | None:
        return None


def test_a_request_that_looks_up_decodes_one_step_a_plain_round_where_calls_are_cheap() -> None:
    # Up to 4 steps a plain round; one for a request that drafts by lookup while a round's
    # overhead is small against a 40 ms step (a lookup may match after the next token), but
    # not where the call costs a quarter of the step, which multi-step rounds save.
    async def test(sched: Scheduler) -> None:
        sched.planner = Planner(TARGET, [], clock=still)
        for overhead_s, lookup_steps in ((0.001, 1), (0.010, 4)):
            sched.planner.costs.overhead_s = overhead_s
            for method, steps in ((SpeculationMethod.NGRAM, lookup_steps), (SpeculationMethod.NONE, 4)):
                seq = new_request(request(max_new_tokens=50), policy(has_draft=False, method=method))
                assert sched._plan([seq]).steps == {seq.slot_id: steps}

    run(test, FakeTarget(), None, lookup=NoMatches(LookupSettings()), decode_steps=4)


def test_a_request_whose_lookups_have_not_drafted_for_a_while_takes_multi_step_rounds() -> None:
    async def test(sched: Scheduler) -> None:
        sched.planner = Planner(TARGET, [], clock=still)
        sched.planner.costs.overhead_s = 0.001
        seq = new_request(request(max_new_tokens=50), policy(has_draft=False, method=SpeculationMethod.NGRAM))
        for _ in range(LOOKUP_PLAIN_STREAK - 1):
            seq.counts.record(0, 0)
        assert sched._plan([seq]).steps == {seq.slot_id: 1}
        seq.counts.record(0, 0)
        assert sched._plan([seq]).steps == {seq.slot_id: 4}
        seq.counts.record(3, 2, DraftSource.PROMPT_LOOKUP)  # a lookup drafted: one step again
        assert sched._plan([seq]).steps == {seq.slot_id: 1}

    run(test, FakeTarget(), None, lookup=NoMatches(LookupSettings()), decode_steps=4)


def test_auto_mixes_lookups_and_the_model_draft_and_leaves_the_drafts_cache_alone() -> None:
    # The fake draft is wrong at position 2, so whatever source drafts, rounds reject too.
    target, draft = FakeTarget(), FakeDraft(wrong_at={2})

    async def test(sched: Scheduler) -> None:
        seq = await generate(sched, SpeculationMethod.AUTO, 80)
        assert seq.tokens[len(seq.prompt):] == greedy_reference(prompt_ids(), 80)
        counts = seq.counts
        assert 0 < counts.lookup_rounds < counts.rounds  # both sources drafted
        # The draft only ever saw tokens in order: every Propose resumed where its cache was valid.
        fed = sum(len(item.new_tokens) for call in draft.calls for item in call)
        assert fed <= len(seq.tokens)

    run_with_lookups(test, target, draft)
    assert target.slots == {} and draft.slots == {}


class ShortLookups(LookupProposer):
    """Lookups cut to two tokens: shorter than K, so the draft model drafts with them as a guess."""

    def propose(
        self, slot_id: str, tokens: list[int], k: int, stop_token_ids: Collection[int] = ()
    ) -> LookupDraft | None:
        draft = super().propose(slot_id, tokens, k, stop_token_ids)
        return None if draft is None else draft.truncated(2)


def test_the_model_draft_gets_a_lookup_too_short_to_verify_alone_as_its_guess() -> None:
    # At a fixed K without costs, a lookup shorter than K goes to the draft model as a guess;
    # what the target judges is the draft's proposal, as in any model round.
    target, draft = FakeTarget(), FakeDraft(wrong_at={3})

    async def test(sched: Scheduler) -> None:
        seq = await generate(sched, SpeculationMethod.AUTO, 80)
        assert seq.tokens[len(seq.prompt):] == greedy_reference(prompt_ids(), 80)
        guessed = [item for call in draft.calls for item in call if item.guess_tokens]
        assert guessed and all(len(item.guess_tokens) == 2 for item in guessed)
        counts = seq.counts
        assert counts.guided_rounds == len(guessed) and counts.lookup_rounds == 0
        # The toy text repeats, so the guesses (lookups once a period has passed) are the target's
        # text, which the fake draft proposes too up to its wrong third token: both tokens count.
        assert counts.guessed_tokens == 2 * len(guessed)

    run(test, target, draft, lookup=ShortLookups(LookupSettings(min_n=1, max_n=3)))


@pytest.mark.parametrize("method", [SpeculationMethod.AUTO, SpeculationMethod.MODEL])
def test_only_a_request_that_allows_lookups_lets_the_draft_guess_on_its_own(method: SpeculationMethod) -> None:
    target, draft = FakeTarget(), FakeDraft(wrong_at={3})

    async def test(sched: Scheduler) -> None:
        await generate(sched, method, 40)
        items = [item for call in draft.calls for item in call]
        assert items and all(item.lookup_guesses is method.allows_lookup for item in items)

    run(test, target, draft, lookup=LookupProposer(LookupSettings()))


def test_a_sampled_lookup_round_sends_one_hot_q_rows() -> None:
    target = FakeTarget()

    async def test(sched: Scheduler) -> None:
        sampling = common_pb2.SamplingParams(temperature=0.7, seed=3)
        seq = await generate(sched, SpeculationMethod.NGRAM, 70, sampling, gateway_pb2.VERIFICATION_REJECTION)
        assert seq.counts.lookup_rounds > 0

    run_with_lookups(test, target, None)
    sampled = [item for batch in target.verify_batches for item in batch if isinstance(item.mode, SampledMode)]
    assert sampled
    for item in sampled:
        assert isinstance(item.mode, SampledMode)
        q = item.mode.draft_probs
        assert q.lengths == (1,) * (len(item.tokens) - 1) and q.token_ids.tolist() == item.tokens[1:]
        assert q.values.tolist() == [1.0] * (len(item.tokens) - 1)


def test_the_suffix_cache_drafts_from_an_earlier_answer() -> None:
    target = FakeTarget()

    async def test(sched: Scheduler) -> None:
        first = await generate(sched, SpeculationMethod.NGRAM, 20)
        second = await generate(sched, SpeculationMethod.NGRAM, 20)
        assert second.tokens == first.tokens
        # The first answer had only its own short matches; the second copies the first.
        assert second.counts.lookup_accepted_tokens > first.counts.lookup_accepted_tokens
        assert second.counts.lookup_accepted_tokens >= 15

    run_with_lookups(test, target, None)
