"""The draft gRPC service, end to end over loopback: a real server, the embedded fp32 model.

The draft here is the fp32 model itself, so a greedy draft must equal the model's own
greedy continuation (computed with `transformers`' forward). The int8 + bf16 default
draft is started as a real process in tests/specdec/serving.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from specdec.draft_server.server import SERVICE_NAME
from specdec.model.loader import LoadedModel
from specdec.model.runtime import ModelRuntime
from specdec.sampling.sparse_probs import MIN_DRAFT_PROB
from specdec.v1 import common_pb2, draft_pb2
from specdec.wire import items as wire_items
from specdec.wire.items import Lease, ProposeItem, sparse_from_pb
from tests.support.block_pool import check_pool
from tests.support.services import Service, StartService, greedy_continuation, rpc_error

GREEDY = common_pb2.SamplingParams(temperature=0.0)


def sampled(seed: int | None = 1234, **fields: float) -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams(**{"temperature": 0.8, "top_k": 50, "top_p": 0.95, **fields})
    if seed is not None:
        params.seed = seed
    return params


def item(
    slot_id: str, new_tokens: list[int], k: int, valid_len: int = 0, sampling: common_pb2.SamplingParams = GREEDY
) -> draft_pb2.ProposeItem:
    return draft_pb2.ProposeItem(slot_id=slot_id, valid_len=valid_len, new_tokens=new_tokens, num_speculative_tokens=k,
                                 sampling=sampling)


def guessing(request: draft_pb2.ProposeItem, guess: list[int]) -> draft_pb2.ProposeItem:
    """`request` with a lookup's guess at its drafted tokens."""
    request.guess_tokens.extend(guess)
    return request


def propose(
    service: Service, *items: draft_pb2.ProposeItem, probs_dtype: int = common_pb2.DTYPE_UNSPECIFIED
) -> dict[str, draft_pb2.ProposeResult]:
    response = service.stub.Propose(draft_pb2.ProposeRequest(items=items, probs_dtype=probs_dtype))
    assert [r.slot_id for r in response.results] == [i.slot_id for i in items]
    for result, request in zip(response.results, items):
        assert len(result.tokens) == request.num_speculative_tokens
        # The last drafted token is returned but not cached.
        assert result.cached_len == request.valid_len + len(request.new_tokens) + request.num_speculative_tokens - 1
    return {r.slot_id: r for r in response.results}


#: SmolLM2's vocabulary (test_info checks the service's against the model's).
VOCAB = 49152


def q_of(result: draft_pb2.ProposeResult) -> torch.Tensor:
    """The q rows [K, vocab] as sent, in their wire dtype (zero where the draft cut them)."""
    assert result.HasField("probs")
    rows = sparse_from_pb(result.probs)
    rows.validate(VOCAB, "probs")
    dense = torch.zeros(rows.num_rows, VOCAB, dtype=rows.values.dtype)
    row_index = torch.repeat_interleave(torch.arange(rows.num_rows), torch.tensor(rows.lengths))
    dense[row_index, rows.token_ids] = rows.values
    return dense


# -- Info ---------------------------------------------------------------------------------


def test_info(draft: Service, target_model: LoadedModel) -> None:
    info = draft.info()
    assert info.model_name == target_model.name
    assert info.vocab_size == target_model.model.config.vocab_size == VOCAB
    assert info.eos_token_ids and len(info.tokenizer_fingerprint) == 64
    assert (info.dtype, info.device, info.quantization) == ("float32", "cpu", "")
    assert (info.block_size, info.max_speculative_tokens, info.max_slots) == (16, 8, 32)
    assert info.free_kv_tokens == info.total_kv_tokens == 2048 and info.active_slots == 0


# -- greedy drafting ----------------------------------------------------------------------


def test_greedy_propose_equals_the_models_greedy_continuation(
    draft: Service, target_model: LoadedModel, prompts: list[list[int]]
) -> None:
    prompt = prompts[0]
    result = propose(draft, item("s", prompt, k=6))["s"]
    assert list(result.tokens) == greedy_continuation(target_model, prompt, 6)
    assert not result.HasField("probs")  # greedy requests omit q


def test_a_guess_over_the_wire_leaves_the_proposal_as_it_is(draft: Service, prompts: list[list[int]]) -> None:
    """The draft checks the guess against its own draws (tests/draft_server/test_guesses.py):
    right or wrong, the tokens and the cache are those of a round without it."""
    prompt = prompts[2]
    own = list(propose(draft, item("plain", prompt, k=6))["plain"].tokens)
    for slot, guess, saved in (("right", own[:5], 5), ("wrong", [t ^ 1 for t in own], 0)):
        propose(draft, item(slot, prompt[:-1], k=1))  # the slot holds the prompt but its last token
        result = propose(draft, guessing(item(slot, prompt[-1:], k=6, valid_len=len(prompt) - 1), guess))[slot]
        assert list(result.tokens) == own, slot
        assert result.saved_steps == saved, slot


def test_the_drafts_own_guesses_over_the_wire(start_draft: StartService, full_fp32_runtime: ModelRuntime) -> None:
    """`lookup_guesses` travels: on a text that repeats, the draft (the whole model, which
    copies it) guesses from its own earlier tokens, draws the same tokens and reports the steps
    it saved."""
    draft = start_draft(full_fp32_runtime)
    text = [504, 3575, 282, 4649, 314, 260, 1345, 28] * 4
    results = {}
    for slot, own in (("plain", False), ("own", True)):
        propose(draft, item(slot, text[:-1], k=1))
        request = item(slot, text[-1:], k=8, valid_len=len(text) - 1)
        request.lookup_guesses = own
        results[slot] = propose(draft, request)[slot]
    assert list(results["own"].tokens) == list(results["plain"].tokens)
    assert results["plain"].saved_steps == 0 < results["own"].saved_steps


def test_next_round_rolls_back_and_feeds_the_accepted_tokens(
    draft: Service, target_model: LoadedModel, prompts: list[list[int]]
) -> None:
    """Round 2 keeps 2 of 4 drafted tokens plus a corrected one; round 3 keeps all plus a bonus."""
    prompt = prompts[1]
    n = len(prompt)
    first = list(propose(draft, item("s", prompt, k=4))["s"].tokens)
    correction = (first[2] + 1) % 1000 + 100
    assert correction != first[2]
    second = list(propose(draft, item("s", [correction], k=4, valid_len=n + 2))["s"].tokens)
    context = prompt + first[:2] + [correction]
    assert second == greedy_continuation(target_model, context, 4)
    # All 4 accepted: the draft cached 3 of them; feed the 4th and a bonus token.
    bonus = 321
    third = propose(draft, item("s", [second[3], bonus], k=3, valid_len=len(context) + 3))["s"]
    context = context + second + [bonus]
    assert list(third.tokens) == greedy_continuation(target_model, context, 3)


def test_lazy_prefill_of_new_slots_at_different_lengths_equals_each_alone(
    draft: Service, target_model: LoadedModel, prompts: list[list[int]]
) -> None:
    ks = [4, 2, 6]
    batched = propose(draft, *[item(f"b{i}", p, k) for i, (p, k) in enumerate(zip(prompts, ks))])
    for i, (prompt, k) in enumerate(zip(prompts, ks)):
        alone = propose(draft, item(f"a{i}", prompt, k))[f"a{i}"]
        assert list(batched[f"b{i}"].tokens) == list(alone.tokens) == greedy_continuation(target_model, prompt, k)


def test_a_long_prompt_is_fed_in_chunks_with_the_same_drafts(
    start_draft: Callable[..., Service], target_model: LoadedModel, prompts: list[list[int]]
) -> None:
    draft = start_draft(prefill_chunk_tokens=8)
    prompt = prompts[2] * 2  # 38 tokens: five chunks
    result = propose(draft, item("s", prompt, k=4), item("t", prompts[0], k=2))
    assert list(result["s"].tokens) == greedy_continuation(target_model, prompt, 4)
    assert list(result["t"].tokens) == greedy_continuation(target_model, prompts[0], 2)


def test_truncate_rpc_then_propose(draft: Service, target_model: LoadedModel, prompts: list[list[int]]) -> None:
    prompt = prompts[2]
    n = len(prompt)
    first = propose(draft, item("s", prompt, k=4))["s"]
    reply = draft.stub.Truncate(common_pb2.TruncateRequest(slot_id="s", new_len=n - 3))
    assert reply.cached_len == n - 3
    again = propose(draft, item("s", prompt[n - 3 :], k=4, valid_len=n - 3))["s"]
    assert list(again.tokens) == list(first.tokens) == greedy_continuation(target_model, prompt, 4)


# -- sampled drafting -----------------------------------------------------------------------


def test_seeded_requests_reproduce_tokens_and_q(start_draft: Callable[..., Service], prompts: list[list[int]]) -> None:
    """The same seeded request sent twice drafts the same tokens from bit-identical q (without
    the prefix cache: the second prompt's cached blocks were computed in another call shape,
    equal up to float rounding; see the next test)."""
    draft = start_draft(prefix_caching=False)
    prompt = prompts[2]
    first = propose(draft, item("x", prompt, 6, sampling=sampled(7)), item("g", prompts[0], 2))["x"]
    again = propose(draft, item("y", prompt, 6, sampling=sampled(7)), item("h", prompts[0], 2))["y"]
    assert list(again.tokens) == list(first.tokens)
    assert torch.equal(q_of(again), q_of(first))
    # The generator is the slot's own and carries over between rounds: round 2 reproduces too.
    n = len(prompt) + 5
    rounds = [
        propose(draft, item(slot, [first.tokens[-1]], 4, valid_len=n, sampling=sampled(7)))[slot] for slot in ("x", "y")
    ]
    assert list(rounds[0].tokens) == list(rounds[1].tokens)
    assert torch.equal(q_of(rounds[0]), q_of(rounds[1]))


def test_a_cached_prompt_drafts_what_a_computed_one_does(draft: Service, prompts: list[list[int]]) -> None:
    """The second slot with a prompt starts from the first's cached blocks and computes only
    the rest: the same seeded tokens, q equal up to float rounding."""
    prompt = prompts[2] * 3  # several whole blocks
    first = propose(draft, item("x", prompt, 6, sampling=sampled(7)))["x"]
    hits = draft.engine.prefix_cache_hits
    again = propose(draft, item("y", prompt, 6, sampling=sampled(7)))["y"]
    assert draft.engine.prefix_cache_hits - hits == (len(prompt) - 1) // 16 * 16
    assert list(again.tokens) == list(first.tokens)
    torch.testing.assert_close(q_of(again), q_of(first), atol=5e-5, rtol=0)
    check_pool(draft.engine.cache.blocks, draft.engine.tokens)


def test_seeded_sampling_is_independent_of_the_batch(draft: Service, prompts: list[list[int]]) -> None:
    """Batched or alone, a seeded request draws the same tokens (q equal up to float rounding)."""
    ks = [3, 6, 4]
    batched = propose(draft, *[item(f"b{i}", p, k, sampling=sampled(100 + i))
                               for i, (p, k) in enumerate(zip(prompts, ks))])
    for i, (prompt, k) in enumerate(zip(prompts, ks)):
        alone = propose(draft, item(f"a{i}", prompt, k, sampling=sampled(100 + i)))[f"a{i}"]
        assert list(batched[f"b{i}"].tokens) == list(alone.tokens)
        # Batched and single rows may run different fp32 kernels (picked per shape by timing):
        # probabilities were seen 1.1e-5 apart.
        torch.testing.assert_close(q_of(batched[f"b{i}"]), q_of(alone), atol=5e-5, rtol=0)


def test_q_rows_are_the_distributions_the_tokens_were_drawn_from(
    draft: Service, target_model: LoadedModel, prompts: list[list[int]]
) -> None:
    k = 6
    result = propose(draft, item("s", prompts[0], k, sampling=sampled(5, repetition_penalty=1.3)))["s"]
    q = q_of(result)
    assert q.dtype == torch.float32 and q.shape == (k, target_model.model.config.vocab_size)
    assert (q >= 0).all()
    # Rows sum to 1 less the tail cut below MIN_DRAFT_PROB: at most 50 tokens of it (top_k = 50).
    assert ((q.sum(dim=-1) <= 1 + 1e-5) & (q.sum(dim=-1) >= 1 - 50 * MIN_DRAFT_PROB - 1e-5)).all()
    assert ((q > 0).sum(dim=-1) <= 50).all()  # top_k = 50
    for row, token in zip(q, result.tokens):
        assert row[token] > 0


def test_q_keeps_only_the_tokens_that_carry_its_mass(draft: Service, prompts: list[list[int]]) -> None:
    """No top-k, no top-p: q's tail below MIN_DRAFT_PROB is cut before the draw, so a row
    travels as a small part of the vocabulary and loses little mass."""
    k = 5
    result = propose(draft, item("s", prompts[2], k, sampling=sampled(3, top_k=0, top_p=1.0)))["s"]
    q = q_of(result)
    kept = (q > 0).sum(dim=-1)  # [k]
    assert (kept >= 1).all() and (kept < VOCAB // 10).all()
    assert ((q == 0) | (q >= MIN_DRAFT_PROB)).all()
    assert (q.sum(dim=-1) > 0.95).all()
    for row, token in zip(q, result.tokens):
        assert row[token] > 0


def test_bf16_probs_dtype_returns_bf16_q(draft: Service, target_model: LoadedModel, prompts: list[list[int]]) -> None:
    k = 4
    result = propose(draft, item("s", prompts[1], k, sampling=sampled(9)), probs_dtype=common_pb2.DTYPE_BFLOAT16)["s"]
    assert result.probs.values.dtype == common_pb2.DTYPE_BFLOAT16
    q = q_of(result)
    assert q.dtype == torch.bfloat16 and q.shape == (k, target_model.model.config.vocab_size)
    assert (q >= 0).all()
    torch.testing.assert_close(q.float().sum(dim=-1), torch.ones(k), atol=2e-2, rtol=0)
    for row, token in zip(q, result.tokens):
        assert row[token] > 0


def test_greedy_and_sampled_requests_in_one_batch(
    draft: Service, target_model: LoadedModel, prompts: list[list[int]]
) -> None:
    results = propose(draft, item("g", prompts[0], 3), item("r", prompts[1], 5, sampling=sampled(None)))
    assert list(results["g"].tokens) == greedy_continuation(target_model, prompts[0], 3)
    assert not results["g"].HasField("probs")
    assert q_of(results["r"]).shape == (5, target_model.model.config.vocab_size)


# -- capacity and concurrency ----------------------------------------------------------------


def test_free_kv_tokens_drop_after_propose_and_release_returns_every_block(
    draft: Service, prompts: list[list[int]]
) -> None:
    start = draft.info()
    propose(draft, *[item(f"s{i}", p, 4, sampling=sampled(i)) for i, p in enumerate(prompts)])
    busy = draft.info()
    assert busy.active_slots == 3 and busy.free_kv_tokens < start.free_kv_tokens
    n = len(prompts[0])
    propose(draft, item("s0", [3], 2, valid_len=n))  # implicit rollback of the drafted tokens
    draft.stub.Truncate(common_pb2.TruncateRequest(slot_id="s1", new_len=1))
    for i in range(3):
        draft.stub.Release(common_pb2.ReleaseRequest(slot_id=f"s{i}"))
    end = draft.info()
    assert (end.free_kv_tokens, end.active_slots) == (start.free_kv_tokens, 0)
    check_pool(draft.engine.cache.blocks, draft.engine.tokens)
    assert not draft.engine.generators  # per-slot generators are forgotten too


def test_propose_reports_the_pools_room_and_what_the_callers_holder_holds(draft: Service) -> None:
    lease = common_pb2.Lease(holder="gw-a", incarnation="1")
    blocks = draft.info().total_kv_tokens // 16
    request = draft_pb2.ProposeRequest(items=[item("a", list(range(300, 320)), 4), item("b", [5, 6], 2)], lease=lease)
    room = draft.stub.Propose(request).room
    assert (room.held_blocks, room.held_slots, room.free_slots) == (3, 2, 32 - 2)  # 23 and 3 tokens cached
    assert room.free_blocks + room.held_blocks == blocks
    for slot in ("a", "b"):
        draft.stub.Release(common_pb2.ReleaseRequest(slot_id=slot))


def test_the_draft_reports_the_growth_reserved_in_a_shared_pool_and_refuses_no_new_slot_for_it(
    draft: Service,
) -> None:
    """specdec.serving.reservations: the target keeps the reserved growth at admission; the
    draft, whose slot for a request comes after the target's, reports it and makes the slot."""
    a, b = common_pb2.Lease(holder="gw-a", incarnation="1"), common_pb2.Lease(holder="gw-b", incarnation="1")
    blocks = draft.info().total_kv_tokens // 16
    mine = item("a", list(range(300, 320)), 4)  # 23 tokens cached: 2 blocks
    mine.max_len = blocks * 16  # reserves the rest of the pool
    assert draft.stub.Propose(draft_pb2.ProposeRequest(items=[mine], lease=a)).room.reserved_blocks == 0  # alone
    theirs = item("b", [5, 6], 2)
    theirs.max_len = 4 * 16
    room = draft.stub.Propose(draft_pb2.ProposeRequest(items=[theirs], lease=b)).room
    assert (room.held_slots, room.reserved_blocks) == (1, blocks - 2 + 4 - 1)  # a's growth and its own
    assert draft.engine.reservations.growth(draft.engine.cache.blocks) == {"a": blocks - 2, "b": 4 - 1}
    for slot in ("a", "b"):
        draft.stub.Release(common_pb2.ReleaseRequest(slot_id=slot))
    assert draft.engine.reservations.growth(draft.engine.cache.blocks) == {}


def test_two_gateways_proposes_in_one_batch_hold_each_new_slot_under_its_own_lease(
    draft: Service, target_model: LoadedModel, prompts: list[list[int]]
) -> None:
    """`propose_together`, as the call merger runs two gateways' Propose calls (the service's
    worker is idle: no rpc is in flight)."""
    leases = [Lease("gw-a", "1"), Lease("gw-b", "1")]
    calls = [([ProposeItem.from_pb(item("ma", prompts[0], 3))], leases[0]),
             ([ProposeItem.from_pb(item("mb", prompts[1], 2)), ProposeItem.from_pb(item("mc", prompts[2], 4))],
              leases[1])]
    proposals = draft.engine.propose_together(calls)
    assert [[p.slot_id for p in call] for call in proposals] == [["ma"], ["mb", "mc"]]
    for call, (items, lease) in zip(proposals, calls):
        for proposal, request in zip(call, items):
            assert draft.engine.leases.holder_of(request.slot_id) == lease.holder
            assert list(proposal.tokens) == greedy_continuation(target_model, request.new_tokens,
                                                                request.num_speculative_tokens)
    for slot in ("ma", "mb", "mc"):
        draft.stub.Release(common_pb2.ReleaseRequest(slot_id=slot))


def test_many_slots_at_once(start_draft: Callable[..., Service], target_model: LoadedModel) -> None:
    service = start_draft(max_slots=24, kv_token_budget=24 * 32)
    slots = {f"m{i:02d}": [(7 * i + j) % 4000 + 10 for j in range(3 + i % 9)] for i in range(24)}
    results = propose(service, *[
        item(s, p, 3, sampling=GREEDY if i % 2 else sampled(i)) for i, (s, p) in enumerate(slots.items())
    ])
    assert service.info().active_slots == 24
    for slot in ("m01", "m11"):  # greedy ones, spot-checked
        assert list(results[slot].tokens) == greedy_continuation(target_model, slots[slot], 3)
    for slot in slots:
        service.stub.Release(common_pb2.ReleaseRequest(slot_id=slot))
    info = service.info()
    assert (info.free_kv_tokens, info.active_slots) == (info.total_kv_tokens, 0)


def test_health_check_answers_while_propose_runs_on_the_worker(
    draft: Service, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = draft.engine
    started, finish = threading.Event(), threading.Event()
    real_propose = engine.propose_together

    def slow_propose(*args: Any) -> object:
        started.set()
        finish.wait(timeout=60)
        return real_propose(*args)

    monkeypatch.setattr(engine, "propose_together", slow_propose)
    pending = draft.stub.Propose.future(draft_pb2.ProposeRequest(items=[item("s", prompts[0], 2)]))
    try:
        assert started.wait(timeout=30), "Propose never reached the worker"
        # A deadline well inside the worker's stall (until `finish`, up to a minute).
        reply = draft.health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=20)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert not pending.done()
    finally:
        finish.set()
    assert len(pending.result().results[0].tokens) == 2


# -- error statuses -------------------------------------------------------------------------


def test_unknown_slot_is_not_found(draft: Service) -> None:
    for call, request in [
        (draft.stub.Truncate, common_pb2.TruncateRequest(slot_id="nope", new_len=0)),
        (draft.stub.Release, common_pb2.ReleaseRequest(slot_id="nope")),
    ]:
        error = rpc_error(call, request)
        assert error.code() == grpc.StatusCode.NOT_FOUND and "nope" in error.details()


def test_invalid_arguments_name_the_field(start_draft: Callable[..., Service]) -> None:
    service = start_draft(max_seq_len=40, max_speculative_tokens=4)
    propose(service, item("a", list(range(10, 30)), 3))  # 22 cached tokens
    vocab = service.info().vocab_size

    def request(*items: draft_pb2.ProposeItem, probs_dtype: int = 0) -> draft_pb2.ProposeRequest:
        return draft_pb2.ProposeRequest(items=items, probs_dtype=probs_dtype)

    cases = [
        (request(), "items"),
        (request(item("", [1], 2)), "slot_id"),
        (request(item("d", [1], 2), item("d", [2], 2)), "slot_id"),
        (request(item("new", [], 2)), "new_tokens"),
        (request(item("a", [], 2, valid_len=22)), "new_tokens"),
        (request(item("new", [1, vocab], 2)), "new_tokens"),
        (request(item("new", [-1], 2)), "new_tokens"),
        (request(item("new", [1], 0)), "num_speculative_tokens"),
        (request(item("new", [1], 5)), "k"),  # above max_speculative_tokens = 4
        (request(item("new", [1], 2, valid_len=3)), "valid_len"),  # a new slot starts at 0
        (request(item("a", [1], 2, valid_len=23)), "valid_len"),  # past the cached length
        (request(item("a", [1], 2, valid_len=-1)), "valid_len"),
        (request(item("new", list(range(41)), 1)), ("new_tokens", "max_seq_len")),  # 41 > 40
        (request(item("a", list(range(19)), 1, valid_len=22)), ("new_tokens", "max_seq_len")),  # 22 + 19 > 40
        (request(item("new", list(range(38)), 4)), ("k", "max_seq_len")),  # 38 + 4 > 40
        (request(item("a", list(range(15)), 4, valid_len=22)), ("k", "max_seq_len")),  # 22 + 15 + 4 > 40
        (request(item("new", [1], 2, sampling=common_pb2.SamplingParams(temperature=-1))), "temperature"),
        (request(item("new", [1], 2, sampling=common_pb2.SamplingParams(temperature=1, top_p=1.5))), "top_p"),
        (request(item("new", [1], 2), probs_dtype=99), "dtype"),
        (request(item("new", [1], 2, sampling=common_pb2.SamplingParams(logit_bias={vocab: 1.0}))),
         "sampling.logit_bias"),
        (request(item("new", [1], 2, sampling=common_pb2.SamplingParams(presence_penalty=3))), "presence_penalty"),
        (request(guessing(item("new", [1], 2), [5, 6, 7])), "guess_tokens"),  # more than K
        (request(guessing(item("new", [1], 2), [vocab])), "guess_tokens"),
    ]
    for req, fields in cases:
        error = rpc_error(service.stub.Propose, req)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (req, error.details())
        for field in (fields,) if isinstance(fields, str) else fields:
            assert field in error.details(), (field, error.details())
    error = rpc_error(service.stub.Truncate, common_pb2.TruncateRequest(slot_id="a", new_len=23))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "new_len" in error.details()
    info = service.info()  # no failure created a slot or kept a block
    assert info.active_slots == 1 and info.free_kv_tokens == info.total_kv_tokens - 32


def test_failed_batch_frees_nothing_of_other_requests(
    draft: Service, target_model: LoadedModel, prompts: list[list[int]]
) -> None:
    prompt = prompts[0]
    n = len(prompt)
    first = propose(draft, item("a", prompt, 4))["a"]  # n + 3 cached
    before = draft.info()
    error = rpc_error(draft.stub.Propose, draft_pb2.ProposeRequest(items=[
        item("a", [9], 2, valid_len=n),  # would roll "a" back
        item("fresh", prompts[1], 2),  # would be created
        item("bad", prompts[2], 99),  # k too large: the whole batch fails
    ]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = draft.info()
    assert (after.free_kv_tokens, after.active_slots) == (before.free_kv_tokens, before.active_slots)
    assert rpc_error(draft.stub.Release, common_pb2.ReleaseRequest(slot_id="fresh")).code() == grpc.StatusCode.NOT_FOUND
    # "a" still holds prompt + its 3 cached drafts: continue from there.
    cont = propose(draft, item("a", [first.tokens[3]], 2, valid_len=n + 3))["a"]
    assert list(cont.tokens) == greedy_continuation(target_model, prompt + list(first.tokens), 2)


def test_pool_full_is_resource_exhausted(start_draft: Callable[..., Service], target_model: LoadedModel) -> None:
    service = start_draft(kv_token_budget=64, max_slots=2)  # 4 blocks of 16
    a = list(range(1000, 1030))
    propose(service, item("a", a, 2))  # 31 cached: 2 blocks
    # KV: a new 40-token prompt needs 3 blocks, 2 are free.
    error = rpc_error(service.stub.Propose, draft_pb2.ProposeRequest(items=[item("b", list(range(2000, 2040)), 2)]))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = service.info()
    assert (info.free_kv_tokens, info.active_slots) == (32, 1)
    # Slots: two new ones with one place left.
    error = rpc_error(service.stub.Propose, draft_pb2.ProposeRequest(items=[item("c", [1], 1), item("d", [2], 1)]))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "slots" in error.details()
    assert service.info().active_slots == 1
    # "a" is intact: roll back its drafts and continue.
    cont = propose(service, item("a", [5], 2, valid_len=30))["a"]
    assert list(cont.tokens) == greedy_continuation(target_model, a + [5], 2)


def test_proposals_are_encoded_on_the_model_worker_not_the_event_loop(
    draft: Service, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The q rows' copy to the host runs where they were computed, on the model worker."""
    threads: list[str] = []
    encode = wire_items.sparse_to_pb

    def recording(rows: Any) -> Any:
        threads.append(threading.current_thread().name)
        return encode(rows)

    monkeypatch.setattr(wire_items, "sparse_to_pb", recording)
    propose(draft, item("a", prompts[0], 3, sampling=sampled()), item("b", prompts[1], 2, sampling=sampled()))
    worker = SERVICE_NAME.rsplit(".", 1)[-1]  # the model worker's thread name prefix
    assert len(threads) == 2 and all(name.startswith(worker) for name in threads), threads


def test_a_row_with_nothing_to_draw_fails_its_call_clearly_and_the_next_one_works(
    draft: Service, prompts: list[list[int]]
) -> None:
    """Every logit over a subnormal temperature overflows: q is NaN, the host copy of the drawn
    tokens refuses it with INVALID_ARGUMENT, the new slot is freed, and the service serves on."""
    error = rpc_error(draft.stub.Propose, draft_pb2.ProposeRequest(items=[
        item("a", prompts[0], 2, sampling=sampled(temperature=1e-40)),
    ]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "no distribution to draw from" in error.details()
    assert draft.info().active_slots == 0
    assert len(propose(draft, item("a", prompts[0], 2, sampling=sampled()))["a"].tokens) == 2
