"""The gateway's scheduler and speculation round against fake model services: admission
and on-demand KV with preemption, cache-length bookkeeping, emit and stop rules, cancellation, and the
fallback to plain decoding when the draft fails. Real-stack tests live in tests/gateway."""

from __future__ import annotations

import asyncio
import typing
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest

from specdec.errors import CapacityExhaustedError
from specdec.gateway import intake
from specdec.gateway.generation import Generation
from specdec.gateway.intake import RequestPolicy
from specdec.gateway.request import Delta, Finished, FinishReason, Request
from specdec.gateway.scheduler import Scheduler
from specdec.gateway.speculative_step import advance
from specdec.v1 import common_pb2, gateway_pb2
from specdec.wire.items import ArgmaxMode, DecodeMode, DrawnMode, LogitsMode, SampledMode, VerifyItem
from tests.support.fakes import (
    EOS,
    FakeDraft,
    FakeTarget,
    ToyTokenizer,
    decode_reference,
    greedy_reference,
    policy,
    rpc_error,
    scheduler,
    until,
)

PROMPT = "hello"  # token ids 7 4 11 11 14


def request(prompt: str = PROMPT, max_new_tokens: int = 12, **speculation: Any) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=prompt, max_new_tokens=max_new_tokens, speculation=gateway_pb2.SpeculationOptions(**speculation),
    )


def new_request(req: gateway_pb2.GenerateRequest, request_policy: RequestPolicy) -> Request:
    """A request as `Generations.start` queues it: its `Generation` hears its stream."""
    seq = intake.new_request(req, request_policy)
    Generation(seq)
    return seq


def generation(seq: Request) -> Generation:
    return typing.cast(Generation, seq.events)


async def drain(seq: Request, timeout: float = 10.0) -> tuple[list[int], Finished]:
    """The request's streamed tokens and its final event."""
    tokens, _, finished = await drain_text(seq, timeout)
    return tokens, finished


async def drain_text(seq: Request, timeout: float = 10.0) -> tuple[list[int], str, Finished]:
    tokens: list[int] = []
    text = ""
    while True:
        event = await asyncio.wait_for(generation(seq).outbox.get(), timeout)
        if isinstance(event, Delta):
            tokens.extend(event.tokens)
            text += event.text
        else:
            return tokens, text, event


def run(test: Callable[[Scheduler], Awaitable[None]], target: FakeTarget, draft: FakeDraft | None,
        **limits: Any) -> None:
    async def main() -> None:
        sched = scheduler(target, draft, **limits)
        sched.start()
        try:
            await test(sched)
        finally:
            await sched.stop()

    asyncio.run(main())


def prompt_ids(prompt: str = PROMPT) -> list[int]:
    return [ord(c) - ord("a") for c in prompt]


@pytest.mark.parametrize("wrong_at", [set(), {1}, {3}, {1, 2, 3, 4}])
def test_speculative_output_is_the_targets_greedy_output(wrong_at: set[int]) -> None:
    target, draft = FakeTarget(), FakeDraft(wrong_at=wrong_at)

    async def test(sched: Scheduler) -> None:
        seq = new_request(request(), policy())
        sched.submit(seq)
        tokens, finished = await drain(seq)
        assert tokens == greedy_reference(prompt_ids(), 12)
        assert finished.reason == FinishReason.LENGTH
        counts = seq.counts
        assert counts.rounds > 0
        # Every Verify is one decode round of this request: drafting (K >= 1) or plain (K = 0).
        assert counts.rounds + counts.plain_rounds == len(target.verify_batches)
        if not wrong_at:
            assert counts.accepted_tokens == counts.draft_tokens
        elif 1 in wrong_at:
            assert counts.accepted_tokens == 0
        else:  # wrong at 3: two accepted in every round that drafted at least three
            assert 0 < counts.accepted_tokens <= 2 * counts.rounds

    run(test, target, draft)
    assert target.slots == {} and draft.slots == {}, "both services' slots are released"


def test_cache_lengths_advance_past_the_accepted_tokens_only() -> None:
    """After a round with K=4 where the draft is wrong at position 3: the target holds the
    prompt, g, t1, t2 as valid; the draft holds prompt + t1 (t2 was never fed to it)."""
    target, draft = FakeTarget(), FakeDraft(wrong_at={3})

    async def test(sched: Scheduler) -> None:
        seq = new_request(request(max_new_tokens=40), policy())
        sched.submit(seq)
        await drain(seq)
        first, second = draft.calls[0][0], draft.calls[1][0]
        n = len(prompt_ids())
        # Round 1: the draft sees the prompt plus the first token g; 2 of 4 accepted, then the
        # target's recovered token: 3 new tokens, of which the draft cached t1 and t2 already.
        assert (first.valid_len, len(first.new_tokens)) == (0, n + 1)
        assert second.valid_len == n + 1 + 2 and len(second.new_tokens) == 1
        verify_1, verify_2 = target.verify_batches[0][0], target.verify_batches[1][0]
        assert verify_1.valid_len == n and len(verify_1.tokens) == 1 + 4
        assert verify_2.valid_len == n + 1 + 2 and len(verify_2.tokens) == 1 + 4

    run(test, target, draft)


def test_advance_rule() -> None:
    seq = new_request(request(), policy())
    n = len(seq.tokens)
    advance(seq, k=4, num_accepted=4)
    assert (seq.target_valid, seq.draft_valid) == (n + 4, n + 3)
    advance(seq, k=0, num_accepted=0)
    assert seq.target_valid == n and seq.draft_valid == n + 3, "a plain round leaves the draft's prefix alone"


def test_max_new_tokens_is_exact_even_when_a_round_accepts_more() -> None:
    target, draft = FakeTarget(), FakeDraft()

    async def test(sched: Scheduler) -> None:
        for n in (1, 2, 3, 7):
            seq = new_request(request(max_new_tokens=n), policy())
            sched.submit(seq)
            tokens, finished = await drain(seq)
            assert tokens == greedy_reference(prompt_ids(), n) and finished.reason == FinishReason.LENGTH

    run(test, target, draft)


def test_eos_stops_the_stream_and_is_not_emitted() -> None:
    target, draft = FakeTarget(), FakeDraft()
    counting_up = "h" + chr(ord("a") + 35)  # ... 35 -> 36, 37, 38, EOS

    async def test(sched: Scheduler) -> None:
        seq = new_request(request(prompt=counting_up), policy())
        sched.submit(seq)
        tokens, finished = await drain(seq)
        assert tokens == [36, 37, 38] and finished.reason == FinishReason.STOP
        seq = new_request(request(prompt="h" + chr(ord("a") + 38)), policy())  # EOS comes first
        sched.submit(seq)
        tokens, finished = await drain(seq)
        assert tokens == [] and finished.reason == FinishReason.STOP and seq.completion_tokens == 0

    run(test, target, draft)


def test_the_draft_stops_drafting_at_eos() -> None:
    """No token after EOS could be kept, so the draft is told to stop there and the target
    verifies nothing past it."""
    target, draft = FakeTarget(), FakeDraft()
    counting_up = "h" + chr(ord("a") + 33)  # ... 33 -> 34, 35, 36, 37, 38, EOS

    async def test(sched: Scheduler) -> None:
        seq = new_request(request(prompt=counting_up, num_speculative_tokens=8), policy())
        sched.submit(seq)
        tokens, finished = await drain(seq)
        assert tokens == [34, 35, 36, 37, 38] and finished.reason == FinishReason.STOP
        assert [item.stop_token_ids for call in draft.calls for item in call] == [(EOS,)]
        verified = target.verify_batches[0][0].tokens
        assert verified[-6:] == [34, 35, 36, 37, 38, EOS] and seq.counts.draft_tokens == 5

    run(test, target, draft)


def test_a_draft_sending_too_few_tokens_costs_speculation_not_the_request() -> None:
    target, draft = FakeTarget(), FakeDraft()

    async def test(sched: Scheduler) -> None:
        seq = new_request(request(max_new_tokens=30), policy())
        draft.fault_on_call, draft.fault = 2, "short"
        sched.submit(seq)
        tokens, finished = await drain(seq)
        assert tokens == greedy_reference(prompt_ids(), 30) and finished.reason == FinishReason.LENGTH
        assert sched.stats.draft_failures == 1
        assert all(isinstance(item.mode, DecodeMode) for item in target.verify_batches[1])  # the round ran plain

    run(test, target, draft)


def test_stop_string_ends_the_stream_before_it() -> None:
    target, draft = FakeTarget(), FakeDraft()
    reference = greedy_reference(prompt_ids(), 12)
    stop = "".join(chr(ord("a") + t) for t in reference[5:7])

    async def test(sched: Scheduler) -> None:
        req = request()
        req.stop.append(stop)
        seq = new_request(req, policy())
        sched.submit(seq)
        tokens, text, finished = await drain_text(seq)
        assert finished.reason == FinishReason.STOP
        full_text = ToyTokenizer().decode(reference)
        assert text == full_text[: full_text.index(stop)]
        assert tokens == reference[: len(tokens)]

    run(test, target, draft)


def test_a_full_pool_preempts_the_newest_request_which_resumes_with_the_same_output() -> None:
    """Two requests of 5 + 20 tokens in a pool of 3 blocks of 16 tokens: both are admitted (KV
    is taken on demand), the newer is preempted when the next round no longer fits, and resumes
    from its tokens once the first has finished; both outputs stay exact."""
    target, draft = FakeTarget(), FakeDraft()

    async def test(sched: Scheduler) -> None:
        first, second = (new_request(request(max_new_tokens=20), policy()) for _ in range(2))
        second_id = second.slot_id
        sched.submit(first)
        sched.submit(second)
        (tokens_1, _), (tokens_2, _) = await drain(first), await drain(second)
        assert tokens_1 == tokens_2 == greedy_reference(prompt_ids(), 20)
        await until(lambda: not target.slots and not draft.slots and not sched.running)  # released in the background
        assert second.preemptions >= 1 and first.preemptions == 0
        assert sched.stats.preemptions == second.preemptions
        prefills = [slot for event, slot in target.events if event == "prefill"]
        assert prefills[:2] == [first.slot_id, second_id]  # both admitted at once
        assert second.slot_id == f"{second_id}#{second.preemptions}"  # resumed under a fresh id
        # The resumed Prefill carried the prompt and every token generated before the preemption.
        resumed = target.prefilled[second.slot_id]
        assert (len(resumed) > len(prompt_ids())
                and resumed == prompt_ids() + tokens_2[: len(resumed) - len(prompt_ids())])
        assert target.slots == {} and draft.slots == {} and sched.running == []

    run(test, target, draft, kv_tokens=48)


def test_huge_requests_cannot_starve_short_ones() -> None:
    """Two requests asking for 10**9 tokens, then short ones: the short ones are admitted next
    to the huge ones and finish while those still run (no worst-case reservation)."""
    target, draft = FakeTarget(), FakeDraft()

    async def test(sched: Scheduler) -> None:
        huge = [new_request(request(max_new_tokens=10**9), policy()) for _ in range(2)]
        for seq in huge:
            sched.submit(seq)
        short = [new_request(request(max_new_tokens=8), policy()) for _ in range(6)]
        for seq in short:
            sched.submit(seq)
            tokens, finished = await drain(seq)
            assert tokens == greedy_reference(prompt_ids(), 8) and finished.reason == FinishReason.LENGTH
        assert not any(seq.done for seq in huge), "the short requests finished while the huge ones ran"
        for seq in huge:
            tokens, finished = await drain(seq, timeout=30)
            assert finished.reason == FinishReason.LENGTH and len(tokens) == 256 - len(PROMPT)
        await until(lambda: not target.slots and not draft.slots)

    run(test, target, draft, kv_tokens=512)  # the two huge requests alone can fill it


def test_a_full_queue_is_refused() -> None:
    target, draft = FakeTarget(), FakeDraft()

    async def test(sched: Scheduler) -> None:
        blockers = [new_request(request(max_new_tokens=20), policy()) for _ in range(2)]
        for seq in blockers:  # submitted without yielding to the scheduler: both wait
            sched.submit(seq)
        with pytest.raises(CapacityExhaustedError, match="admission queue is full"):
            sched.submit(new_request(request(), policy()))
        for seq in blockers:
            await drain(seq)

    run(test, target, draft, kv_tokens=32, max_queue=2)


def test_cancelling_a_running_request_frees_its_slots_in_both_services() -> None:
    # Rounds of at least 10 ms: the 200 tokens cannot all be decoded before the cancel lands.
    target, draft = FakeTarget(verify_delay_s=0.01), FakeDraft()

    async def test(sched: Scheduler) -> None:
        seq = new_request(request(max_new_tokens=200), policy())
        sched.submit(seq)
        while not draft.calls:
            await asyncio.sleep(0.001)
        sched.cancel(seq)
        _, finished = await drain(seq)
        assert finished.reason == FinishReason.CANCELLED
        await until(lambda: bool(target.released and draft.released))
        assert target.released == [seq.slot_id] and draft.released == [seq.slot_id]
        assert sched.running == []

    run(test, target, draft)


def test_a_stop_during_a_finished_requests_release_still_releases_it() -> None:
    """A drain ends as the last final message goes out, before that request's Release has
    returned: the stop that follows must free its slots, not leave them to lease expiry."""
    target, draft = FakeTarget(release_delay_s=0.2), FakeDraft()

    async def main() -> None:
        sched = scheduler(target, draft)
        sched.start()
        seq = new_request(request(max_new_tokens=4), policy())
        sched.submit(seq)
        _, finished = await drain(seq)
        assert finished.reason == FinishReason.LENGTH and not target.released  # its Release is under way
        await sched.stop()
        assert target.released == [seq.slot_id] and seq.slot_id in draft.released  # (the draft's twice: harmless)

    asyncio.run(main())


def test_a_cancelled_waiting_request_never_reaches_the_services() -> None:
    target, draft = FakeTarget(), FakeDraft()

    async def test(sched: Scheduler) -> None:
        running, waiting = (new_request(request(max_new_tokens=20), policy()) for _ in range(2))
        sched.submit(running)
        sched.submit(waiting)
        sched.cancel(waiting)
        assert list(sched.waiting) == [running], "a cancelled request left the queue at once"
        _, finished = await drain(waiting)
        assert finished.reason == FinishReason.CANCELLED
        await drain(running)
        assert waiting.slot_id not in {i.slot_id for batch in target.verify_batches for i in batch}

    run(test, target, draft, kv_tokens=32)


@pytest.mark.parametrize("failure", ["unavailable", "cache_out_of_step"])
def test_a_failing_draft_leaves_the_output_unchanged(failure: str) -> None:
    target, draft = FakeTarget(), FakeDraft()

    async def test(sched: Scheduler) -> None:
        seq = new_request(request(max_new_tokens=30), policy())
        draft.fault_on_call = calls_before = 2
        draft.fault = rpc_error(grpc.StatusCode.UNAVAILABLE, "draft down") if failure == "unavailable" else 1
        sched.submit(seq)
        tokens, finished = await drain(seq)
        assert tokens == greedy_reference(prompt_ids(), 30) and finished.reason == FinishReason.LENGTH
        assert sched.stats.draft_failures >= 1 and sched.stats.off_rounds["draft_unavailable"] >= 1
        # After the failure the draft is sent the whole sequence again (its cache is suspect).
        assert any(item.valid_len == 0 for call in draft.calls[calls_before:] for item in call)

    run(test, target, draft)


def test_a_draft_sending_a_malformed_q_costs_speculation_not_the_request() -> None:
    """q rows that do not give the drafted tokens a chance would make the target refuse the
    Verify; the gateway catches them, and the round runs plain."""
    target, draft = FakeTarget(), FakeDraft()

    async def test(sched: Scheduler) -> None:
        req = request(max_new_tokens=30)
        req.sampling.CopyFrom(common_pb2.SamplingParams(temperature=0.7, seed=3))
        seq = new_request(req, policy())
        draft.fault_on_call, draft.fault = 2, "bad_q"
        sched.submit(seq)
        tokens, finished = await drain(seq)
        assert finished.reason == FinishReason.LENGTH and len(tokens) == 30
        assert sched.stats.draft_failures == 1 and sched.stats.off_rounds["draft_unavailable"] >= 1
        assert all(isinstance(item.mode, DecodeMode) for item in target.verify_batches[1])  # the round ran plain

    run(test, target, draft)


def test_a_failing_target_ends_the_requests_with_its_status_and_releases_them() -> None:
    """A failure no restart explains (tests/unit/gateway/test_target_outage.py has those)."""
    target, draft = FakeTarget(), FakeDraft()

    async def test(sched: Scheduler) -> None:
        seq = new_request(request(max_new_tokens=50), policy())
        target.fail_verify = rpc_error(grpc.StatusCode.UNKNOWN, "stream reset at 10.0.0.7")
        sched.submit(seq)
        _, finished = await drain(seq)
        assert finished.reason == FinishReason.ERROR and generation(seq).error_status == grpc.StatusCode.UNKNOWN
        assert "UNKNOWN" in finished.error and "10.0.0.7" not in finished.error  # details stay in the log
        await until(lambda: bool(draft.released))
        assert draft.released == [seq.slot_id]

    run(test, target, draft)


def test_a_call_cancelled_under_the_round_fails_its_requests_not_the_scheduler() -> None:
    """grpc can cancel a call from inside (a request stream that raised): the round's requests
    end with an error and are released, and the scheduler goes on serving."""
    target, draft = FakeTarget(), FakeDraft()

    async def test(sched: Scheduler) -> None:
        first, second = (new_request(request(max_new_tokens=20), policy()) for _ in range(2))
        target.fail_verify = asyncio.CancelledError()
        sched.submit(first)
        _, finished = await drain(first)
        assert finished.reason == FinishReason.ERROR and "cancelled" in finished.error
        target.fail_verify = None
        sched.submit(second)
        tokens, finished = await drain(second)
        assert finished.reason == FinishReason.LENGTH and tokens == greedy_reference(prompt_ids(), 20)

    run(test, target, draft)


def test_plain_requests_never_call_the_draft() -> None:
    target, draft = FakeTarget(), FakeDraft()

    async def test(sched: Scheduler) -> None:
        seq = new_request(request(enabled=False), policy())
        sched.submit(seq)
        tokens, _ = await drain(seq)
        assert tokens == greedy_reference(prompt_ids(), 12)
        assert draft.calls == [] and all(len(i.tokens) == 1 for batch in target.verify_batches for i in batch)

    run(test, target, draft)


def test_plain_greedy_rounds_decode_several_tokens_a_verify_and_stop_where_one_step_would() -> None:
    """Multi-step: a plain greedy request gets up to 4 tokens a Verify, never more than it
    may still emit, with the same tokens; an EOS inside a multi-step round ends the stream there."""
    target, draft = FakeTarget(), FakeDraft()
    counting_up = "h" + chr(ord("a") + 33)  # ... 33 -> 34, 35, 36, 37, 38, EOS

    async def test(sched: Scheduler) -> None:
        seq = new_request(request(max_new_tokens=10, enabled=False), policy())
        sched.submit(seq)
        tokens, finished = await drain(seq)
        assert tokens == greedy_reference(prompt_ids(), 10) and finished.reason == FinishReason.LENGTH
        # The first token comes from the prefill; then 4 + 4 + 1.
        assert [steps(item) for batch in target.verify_batches for item in batch] == [4, 4, 1]
        assert sched.stats.emitted_tokens == 9
        seq = new_request(request(counting_up, max_new_tokens=20, enabled=False), policy())
        sched.submit(seq)
        tokens, finished = await drain(seq)
        assert tokens == [34, 35, 36, 37, 38] and finished.reason == FinishReason.STOP
        assert draft.calls == []
        seq = new_request(request(max_new_tokens=10), policy())  # speculating: one step a round
        sched.submit(seq)
        assert (await drain(seq))[0] == greedy_reference(prompt_ids(), 10) and draft.calls
        assert {steps(i) for b in target.verify_batches for i in b if i.slot_id == seq.slot_id} == {1}

    run(test, target, draft, decode_steps=4)
    assert target.slots == {}


def test_a_full_batch_decodes_multi_step_with_a_queue() -> None:
    """The queue waits for a slot either way, so a full batch keeps decoding several tokens
    a Verify."""
    target, draft = FakeTarget(), FakeDraft()

    async def test(sched: Scheduler) -> None:
        first, second = (new_request(request(max_new_tokens=9, enabled=False), policy()) for _ in range(2))
        sched.submit(first)
        sched.submit(second)  # max_batch_size 1: it waits until the first is done
        for seq in (first, second):
            assert (await drain(seq))[0] == greedy_reference(prompt_ids(), 9)
        assert steps_of(target, first) == [3, 3, 2] and steps_of(target, second) == [3, 3, 2]

    run(test, target, draft, decode_steps=3, max_batch_size=1)


def test_a_multi_step_round_the_target_cut_short_emits_what_it_decoded() -> None:
    """Near a call's deadline the target returns fewer tokens than asked (at least one):
    the request advances by those, and its output is unchanged."""
    target, draft = FakeTarget(max_decoded=2), FakeDraft()

    async def test(sched: Scheduler) -> None:
        seq = new_request(request(max_new_tokens=9, enabled=False), policy())
        sched.submit(seq)
        assert (await drain(seq))[0] == greedy_reference(prompt_ids(), 9)
        assert steps_of(target, seq) == [4, 4, 4, 2]  # 8 tokens after the first, 2 a call

    run(test, target, draft, decode_steps=4)
    assert target.slots == {}


def test_plain_sampled_and_penalised_requests_have_the_target_choose_their_tokens_multi_step() -> None:
    """A plain request whose logits need transforms sends them with its target seed; the
    target decodes its tokens (several a call) and the gateway emits exactly those."""
    target, draft = FakeTarget(), FakeDraft()
    modes = {
        "sampled": common_pb2.SamplingParams(temperature=0.7, top_k=5, seed=5),
        "penalised": common_pb2.SamplingParams(repetition_penalty=1.3),
        "unseeded": common_pb2.SamplingParams(temperature=0.7),
    }

    async def test(sched: Scheduler) -> None:
        seqs = {}
        for name, sampling in modes.items():
            req = request(max_new_tokens=9, enabled=False)
            req.sampling.CopyFrom(sampling)
            seqs[name] = new_request(req, policy())
            sched.submit(seqs[name])
        outputs = {name: (await drain(seq))[0] for name, seq in seqs.items()}
        for name, seq in seqs.items():
            items = [item for batch in target.verify_batches for item in batch if item.slot_id == seq.slot_id]
            assert {typing.cast(DecodeMode, item.mode).sampling for item in items} == {seq.target_sampling}, name
            assert sum(steps(item) for item in items) == 9 - 1 and max(steps_of(target, seq)) == 3, name
        assert seqs["sampled"].target_sampling.seed not in (None, 5)
        assert seqs["unseeded"].target_sampling.seed is None
        for name in ("sampled", "penalised"):  # seeded or greedy: what the target decoded, token for token
            first, *rest = outputs[name]  # the first token comes from the Prefill's logits, at the gateway
            assert rest == decode_reference(prompt_ids() + [first], 8, seqs[name].target_sampling), name

    run(test, target, draft, decode_steps=3)


def test_a_round_decodes_one_step_while_a_waiting_request_could_join() -> None:
    """A request that arrives during the second admission's Prefill is left for the next
    iteration; the round before it takes one step a request, so it joins one step later,
    not three. From then on the batch decodes multi-step."""
    target, draft = FakeTarget(prefill_gate=asyncio.Event()), FakeDraft()

    async def test(sched: Scheduler) -> None:
        first = new_request(request(enabled=False), policy())
        sched.submit(first)
        await until(lambda: len(target.prefills_started) == 1)  # inside first's Prefill
        second = new_request(request(enabled=False), policy())
        sched.submit(second)  # admitted right after it, in a second Prefill
        target.open_gate()
        await until(lambda: len(target.prefills_started) == 2)  # inside second's Prefill
        late = new_request(request(enabled=False), policy())
        sched.submit(late)
        target.open_gate(for_good=True)
        for seq in (first, second, late):
            assert (await drain(seq))[0] == greedy_reference(prompt_ids(), 12)
        assert [steps(item) for item in target.verify_batches[0]] == [1, 1]
        assert [item.slot_id for item in target.verify_batches[1]] == [first.slot_id, second.slot_id, late.slot_id]
        assert [steps(item) for item in target.verify_batches[1]] == [3, 3, 3]

    run(test, target, draft, decode_steps=3)


def steps(item: VerifyItem) -> int:
    """The tokens a Verify item asked the target to decode (1 for an item that drafted)."""
    return item.mode.steps if isinstance(item.mode, DecodeMode) else 1


def steps_of(target: FakeTarget, seq: Request) -> list[int]:
    """The steps of each Verify item the request sent."""
    return [steps(item) for batch in target.verify_batches for item in batch if item.slot_id == seq.slot_id]


def test_a_hung_draft_costs_one_deadline_then_rounds_run_plain_until_its_health_check_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A health check every 10 ms: the request (rounds of at least 30 ms) outlives many of them.
    monkeypatch.setattr("specdec.gateway.scheduler.DRAFT_RECHECK_S", 0.01)
    target, draft = FakeTarget(), FakeDraft()

    async def test(sched: Scheduler) -> None:
        seq = new_request(request(max_new_tokens=60), policy())
        sched.submit(seq)
        while len(draft.calls) < 2:
            await asyncio.sleep(0.001)
        draft.propose_delay_s, draft.healthy = 10.0, False  # hung, as under SIGSTOP
        while not sched.draft_degraded:
            await asyncio.sleep(0.001)
        assert sched.stats.speculation_enabled == 0
        calls_while_hung = len(draft.calls)
        await asyncio.sleep(0.05)
        assert len(draft.calls) == calls_while_hung, "a degraded draft was sent Propose"
        assert draft.health_checks >= 1
        draft.propose_delay_s, draft.healthy = 0.0, True
        tokens, finished = await drain(seq)
        assert tokens == greedy_reference(prompt_ids(), 60) and finished.reason == FinishReason.LENGTH
        assert not sched.draft_degraded and sched.stats.speculation_enabled == 1

    target.verify_delay_s = 0.03
    run(test, target, draft, deadline_s=0.05)
    assert len(draft.calls) > 2, "speculation never resumed"


def test_a_hung_target_ends_its_requests_unavailable_and_frees_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each round misses its deadline; the request is prefilled again (a restart would explain
    the hang) until it has waited `RESUME_WITHIN_S`, then fails UNAVAILABLE, naming the hang."""
    monkeypatch.setattr("specdec.gateway.target_outage.RESUME_WITHIN_S", 0.5)
    monkeypatch.setattr("specdec.gateway.target_outage.RETRY_S", 0.02)
    target, draft = FakeTarget(verify_delay_s=10.0), FakeDraft()

    async def test(sched: Scheduler) -> None:
        seq = new_request(request(max_new_tokens=20), policy())
        sched.submit(seq)
        _, finished = await drain(seq)
        assert finished.reason == FinishReason.ERROR and "DEADLINE_EXCEEDED and did not come back" in finished.error
        assert generation(seq).error_status == grpc.StatusCode.UNAVAILABLE
        assert len(target.prefills_started) >= 2  # it was tried again
        await until(lambda: not target.slots and not draft.slots and bool(draft.released))

    run(test, target, draft, deadline_s=0.1)


def test_a_failed_release_is_retried_until_the_slot_is_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A live gateway keeps renewing its lease, so a slot whose Release failed would never
    expire: the scheduler tries again in the background."""
    monkeypatch.setattr("specdec.gateway.slot_releases.RELEASE_RETRY_S", 0.01)
    target, draft = FakeTarget(failing_releases=2), FakeDraft()

    async def test(sched: Scheduler) -> None:
        seq = new_request(request(max_new_tokens=6), policy())
        sched.submit(seq)
        await drain(seq)
        await until(lambda: not target.slots)
        assert target.released == [seq.slot_id]
        assert sched.releases.unreleased == {"target": set(), "draft": set()}

    run(test, target, draft)


def test_each_kind_of_request_asks_for_the_verify_mode_it_needs() -> None:
    """A drafting greedy request asks the target for argmax tokens only (K + 1 ints instead of
    K + 1 vocabulary rows); a greedy one with a repetition penalty needs the logits, a seeded
    sampled one the target's own draws and one judged by rejection sampling its candidates. In
    one batch all four decode as they would alone; the drawn one emits plain decoding's tokens."""
    target, draft = FakeTarget(), FakeDraft()
    modes = {
        "plain": common_pb2.SamplingParams(),
        "penalised": common_pb2.SamplingParams(repetition_penalty=1.3),
        "drawn": common_pb2.SamplingParams(temperature=0.7, seed=5),
        "sampled": common_pb2.SamplingParams(temperature=0.7, seed=6),
    }

    async def test(sched: Scheduler) -> None:
        seqs = {}
        for name, sampling in modes.items():
            req = request()
            req.sampling.CopyFrom(sampling)
            if name == "sampled":
                req.speculation.verification = gateway_pb2.VERIFICATION_REJECTION
            seqs[name] = new_request(req, policy())
            sched.submit(seqs[name])
        outputs = {name: (await drain(seq))[0] for name, seq in seqs.items()}
        assert outputs["plain"] == greedy_reference(prompt_ids(), 12)
        asked = {item.slot_id: type(item.mode) for batch in target.verify_batches for item in batch
                 if len(item.tokens) > 1}
        assert asked == {seqs["plain"].slot_id: ArgmaxMode, seqs["penalised"].slot_id: LogitsMode,
                         seqs["drawn"].slot_id: DrawnMode, seqs["sampled"].slot_id: SampledMode}
        first, *rest = outputs["drawn"]  # the first token comes from the Prefill's logits
        assert rest == decode_reference(prompt_ids() + [first], len(rest), seqs["drawn"].target_sampling)

    run(test, target, draft)


def test_requests_that_arrive_during_a_prefill_join_the_first_round() -> None:
    """A burst: the first request's Prefill is under way when two more arrive. They are
    admitted (in one more Prefill) before the first round, so that round, and the K it
    plans, covers all three; the first request does not decode alone meanwhile."""
    target, draft = FakeTarget(prefill_gate=asyncio.Event()), FakeDraft()

    async def test(sched: Scheduler) -> None:
        first = new_request(request(), policy())
        sched.submit(first)
        await until(lambda: len(target.prefills_started) == 1)  # the scheduler is inside first's Prefill now
        later = [new_request(request(), policy()) for _ in range(2)]
        for seq in later:
            sched.submit(seq)
        target.open_gate(for_good=True)
        for seq in (first, *later):
            assert (await drain(seq))[0] == greedy_reference(prompt_ids(), 12)
        assert [item.slot_id for item in target.verify_batches[0]] == [first.slot_id] + [s.slot_id for s in later]

    run(test, target, draft)
