"""The target gRPC service, end to end over loopback: a real server, the embedded fp32 model.

Every logit the service returns is checked against `transformers`' own forward over the
same tokens (the in-process reference), at the 1e-4 tolerance of the parity tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from specdec.errors import CAPACITY_TRAILER
from specdec.model.loader import LoadedModel
from specdec.model.tokenizer_info import TokenizerInfo
from specdec.sampling.draws import make_generator, pick_tokens
from specdec.sampling.params import independent_seed
from specdec.sampling.rejection_sampler import draw_candidates, token_probs
from specdec.sampling.sparse_probs import SparseRows
from specdec.sampling.token_masks import TokenMasks
from specdec.sampling.transforms import chunk_logits_to_probs, logits_to_probs
from specdec.serving import reservations
from specdec.serving.metrics import ServiceStats
from specdec.serving.serial_executor import SerialExecutor
from specdec.target_server import server as target_servicer
from specdec.target_server.engine import TargetEngine
from specdec.target_server.server import SERVICE_NAME
from specdec.v1 import common_pb2, target_pb2
from specdec.wire import items as wire_items
from specdec.wire.items import DecodeMode, VerifiedDecode, VerifyItem, sampling_from_pb, sparse_from_pb, sparse_to_pb
from specdec.wire.tensor_codec import decode_tensor, encode_tensor
from specdec.wire.token_masks import token_masks_to_pb
from tests.support.block_pool import check_pool
from tests.support.services import Service, StartService, greedy_continuation, reference_logits, rpc_error

#: Logit tolerance. Batched and single rows may run different fp32 kernels (oneDNN or BLAS,
#: picked per shape by a start-up timing; inputs past 16 rows always on BLAS), which sum in
#: another order: up to ~1.5e-4 apart on these logits (measured), far below any argmax gap
#: the greedy parity tests depend on.
ATOL = 2e-4


def prefill(service: Service, items: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """Prefill slot -> prompt; returns slot -> last-position logits [vocab]."""
    response = service.stub.Prefill(
        target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(slot_id=s, prompt_tokens=p) for s, p in items.items()])
    )
    assert [r.slot_id for r in response.results] == list(items)
    for result, prompt in zip(response.results, items.values()):
        assert result.cached_len == len(prompt)
    return {r.slot_id: decode_tensor(r.logits) for r in response.results}


def verify(service: Service, items: list[tuple[str, int, list[int]]]) -> dict[str, torch.Tensor]:
    """Verify (slot, valid_len, [g, t1..tK]) items; returns slot -> logits [K + 1, vocab]."""
    response = service.stub.Verify(
        target_pb2.VerifyRequest(
            items=[target_pb2.VerifyItem(slot_id=s, valid_len=v, tokens=t) for s, v, t in items]
        )
    )
    assert [r.slot_id for r in response.results] == [s for s, _, _ in items]
    for result, (_, valid_len, tokens) in zip(response.results, items):
        assert result.cached_len == valid_len + len(tokens)
    return {r.slot_id: decode_tensor(r.logits) for r in response.results}


def release(service: Service, slot_id: str) -> None:
    service.stub.Release(common_pb2.ReleaseRequest(slot_id=slot_id))


def truncate(service: Service, slot_id: str, new_len: int) -> int:
    return service.stub.Truncate(common_pb2.TruncateRequest(slot_id=slot_id, new_len=new_len)).cached_len


# -- Info ---------------------------------------------------------------------------------


def test_info_advertises_model_tokenizer_and_capacity(target: Service, target_model: LoadedModel) -> None:
    info = target.info()
    expected = TokenizerInfo.of(target_model.model, target_model.tokenizer)
    assert info.model_name == target_model.name
    assert info.vocab_size == expected.vocab_size == target_model.model.config.vocab_size
    assert tuple(info.eos_token_ids) == expected.eos_token_ids and info.eos_token_ids
    assert info.tokenizer_fingerprint == expected.fingerprint and len(info.tokenizer_fingerprint) == 64
    assert info.block_size == 16
    assert info.total_kv_tokens == info.free_kv_tokens == 2048
    assert info.max_seq_len == 2048  # the pool is smaller than the model's 8192 positions
    assert (info.max_slots, info.active_slots, info.max_speculative_tokens) == (32, 0, 8)
    assert (info.dtype, info.device, info.quantization) == ("float32", "cpu", "")


def test_free_kv_tokens_drop_after_prefill_and_return_after_release(target: Service) -> None:
    start = target.info().free_kv_tokens
    prefill(target, {"a": list(range(100, 120)), "b": list(range(200, 205))})  # 20 + 5 tokens
    info = target.info()
    assert info.free_kv_tokens == start - 3 * 16  # two blocks for a, one for b
    assert info.active_slots == 2
    release(target, "a")
    assert target.info().free_kv_tokens == start - 16
    release(target, "b")
    info = target.info()
    assert (info.free_kv_tokens, info.active_slots) == (start, 0)



def test_prefill_and_verify_report_the_pools_room_and_what_the_callers_holder_holds(target: Service) -> None:
    mine, other = common_pb2.Lease(holder="gw-a", incarnation="1"), common_pb2.Lease(holder="gw-b", incarnation="1")
    blocks = target.info().total_kv_tokens // 16
    target.stub.Prefill(target_pb2.PrefillRequest(
        items=[target_pb2.PrefillItem(slot_id="theirs", prompt_tokens=list(range(300, 305)))], lease=other))
    room = target.stub.Prefill(target_pb2.PrefillRequest(
        items=[target_pb2.PrefillItem(slot_id="mine", prompt_tokens=list(range(400, 420)))], lease=mine)).room
    assert (room.held_blocks, room.held_slots, room.free_slots) == (2, 1, 32 - 2)
    assert room.free_blocks + room.held_blocks == blocks - 1  # the other holder's one block
    verify(target, [("mine", 20, list(range(7, 16)))])
    verify(target, [("mine", 29, list(range(7, 16)))])  # 38 tokens: a third block
    room = target.stub.Verify(target_pb2.VerifyRequest(
        items=[target_pb2.VerifyItem(slot_id="theirs", valid_len=5, tokens=[9])])).room
    assert (room.held_blocks, room.held_slots, room.free_blocks) == (1, 1, blocks - 4)  # the holder of `theirs`
    room = target.stub.Prefill(target_pb2.PrefillRequest(
        items=[target_pb2.PrefillItem(slot_id="again", prompt_tokens=list(range(400, 420)))], lease=mine)).room
    assert (room.held_blocks, room.held_slots) == (3 + 1, 2)  # the cached first block counts once
    for slot in ("mine", "theirs", "again"):
        release(target, slot)


def test_a_shared_pool_keeps_the_reserved_growth_from_new_slots(
    start_target: StartService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """specdec.serving.reservations: a holder alone admits on demand; while another holder's
    slots have growth left, or another holder waits for room, a new slot must fit at its whole
    length (max_len) in the free blocks beyond every slot's reserved growth."""
    monkeypatch.setattr(reservations, "WAITING_S", 600.0)  # a refused holder waits for the whole test
    target = start_target(kv_token_budget=16 * 16)  # 16 blocks of 16
    a, b = common_pb2.Lease(holder="gw-a", incarnation="1"), common_pb2.Lease(holder="gw-b", incarnation="1")

    def new_slot(slot_id: str, max_len: int, lease: common_pb2.Lease) -> common_pb2.PoolRoom:
        item = target_pb2.PrefillItem(slot_id=slot_id, prompt_tokens=list(range(300, 305)), max_len=max_len)
        return target.stub.Prefill(target_pb2.PrefillRequest(items=[item], lease=lease)).room

    room = new_slot("a1", 12 * 16, a)  # reserves 11 blocks past its one
    assert (room.free_blocks, room.reserved_blocks) == (15, 0)  # alone: nothing is kept from its own slots
    assert new_slot("a2", 3 * 16, a).reserved_blocks == 0  # on demand: 13 blocks' growth in 14 free
    with pytest.raises(grpc.RpcError) as refused:
        new_slot("b1", 2 * 16, b)  # 14 free, 13 reserved: one block beyond them
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "reserved" in refused.value.details()
    assert any(key == CAPACITY_TRAILER for key, _ in refused.value.trailing_metadata())
    with pytest.raises(grpc.RpcError):  # gw-b waits for room: gw-a's own new slots now need their whole length
        new_slot("a3", 2 * 16, a)
    room = new_slot("b1", 16, b)  # its whole length in the one block left
    assert (room.free_blocks, room.reserved_blocks, room.held_slots) == (13, 13, 1)
    release(target, "a1")  # gw-b neither waits nor has growth left: gw-a has the pool to itself again
    assert new_slot("a3", 12 * 16, a).reserved_blocks == 0
    for slot in ("a2", "a3", "b1"):
        release(target, slot)
    assert target.engine.reservations.growth(target.engine.cache.blocks) == {}


# -- Prefill and Verify against the in-process forward -----------------------------------


def test_prefill_batch_of_different_lengths_matches_in_process_forward(
    target: Service, target_model: LoadedModel, prompts: list[list[int]]
) -> None:
    logits = prefill(target, {f"p{i}": p for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        got = logits[f"p{i}"]
        assert got.dtype == torch.float32 and got.shape == (target_model.model.config.vocab_size,)
        torch.testing.assert_close(got, reference_logits(target_model, prompt)[-1], atol=ATOL, rtol=0)


def test_verify_logits_match_in_process_forward(
    target: Service, target_model: LoadedModel, prompts: list[list[int]]
) -> None:
    """One batched Verify with K = 0, 3 and 5: K + 1 rows each, fp32 like the model computed them."""
    prefill(target, {f"p{i}": p for i, p in enumerate(prompts)})
    chunks = [[42], [11, 300, 301, 302], [13, 7, 8, 9, 10, 11]]
    logits = verify(target, [(f"p{i}", len(p), c) for i, (p, c) in enumerate(zip(prompts, chunks))])
    for i, (prompt, chunk) in enumerate(zip(prompts, chunks)):
        got = logits[f"p{i}"]
        assert got.dtype == torch.float32 and got.shape == (len(chunk), target_model.model.config.vocab_size)
        expected = reference_logits(target_model, prompt + chunk)[len(prompt) :]
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


ARGMAX = target_pb2.VerifyMode(argmax=target_pb2.VerifyMode.Argmax())


def decode_mode(steps: int, sampling: common_pb2.SamplingParams | None = None) -> target_pb2.VerifyMode:
    return target_pb2.VerifyMode(decode=target_pb2.VerifyMode.Decode(steps=steps, sampling=sampling))


def sampled_mode(sampling: common_pb2.SamplingParams, q: common_pb2.SparseProbs) -> target_pb2.VerifyMode:
    return target_pb2.VerifyMode(sampled=target_pb2.VerifyMode.Sampled(sampling=sampling, draft_probs=q))


def test_argmax_items_get_each_rows_argmax_and_no_logits(target: Service, prompts: list[list[int]]) -> None:
    """In one batch, an Argmax item gets the argmax of exactly the logits a Logits item at
    the same position gets, and no logits; the Logits item is unchanged by its neighbour."""
    prefill(target, {"full": prompts[0], "ids": prompts[0]})
    chunk = [11, 300, 301, 302]
    n = len(prompts[0])
    response = target.stub.Verify(target_pb2.VerifyRequest(items=[
        target_pb2.VerifyItem(slot_id="full", valid_len=n, tokens=chunk),
        target_pb2.VerifyItem(slot_id="ids", valid_len=n, tokens=chunk, mode=ARGMAX),
    ]))
    full, ids = response.results
    assert ids.cached_len == n + len(chunk) and ids.WhichOneof("answer") == "argmax"
    assert list(ids.argmax.ids) == decode_tensor(full.logits).argmax(dim=-1).tolist()


def test_decode_items_decode_greedily_as_one_step_calls_would(
    target: Service, target_model: LoadedModel, prompts: list[list[int]]
) -> None:
    """A Decode item of n steps: the n tokens and the cache of n one-token argmax calls, batched
    with a Logits item and a shorter Decode item; the Logits item is unchanged by them."""
    prompt = prompts[1]
    n = len(prompt)
    prefill(target, {"one": prompt, "multi": prompt, "short": prompt, "plain": prompt})
    g = 13
    expected, tokens = [], [g]
    for step in range(5):  # one argmax step a call
        result = target.stub.Verify(target_pb2.VerifyRequest(items=[
            target_pb2.VerifyItem(slot_id="one", valid_len=n + step, tokens=tokens[-1:], mode=ARGMAX),
        ])).results[0]
        expected.append(result.argmax.ids[0])
        tokens.append(result.argmax.ids[0])
    response = target.stub.Verify(target_pb2.VerifyRequest(items=[
        target_pb2.VerifyItem(slot_id="multi", valid_len=n, tokens=[g], mode=decode_mode(5)),
        target_pb2.VerifyItem(slot_id="short", valid_len=n, tokens=[g], mode=decode_mode(2)),
        target_pb2.VerifyItem(slot_id="plain", valid_len=n, tokens=[g, 20, 21]),
    ]))
    multi, short, plain = response.results
    assert list(multi.decoded.ids) == expected and multi.cached_len == n + 5
    assert list(short.decoded.ids) == expected[:2] and short.cached_len == n + 2
    assert plain.cached_len == n + 3
    torch.testing.assert_close(decode_tensor(plain.logits), reference_logits(target_model, prompt + [g, 20, 21])[n:],
                               atol=ATOL, rtol=0)
    # The cache holds g and the first four decoded tokens: the next position scores as after them.
    after = verify(target, [("multi", n + 5, [expected[4]])])["multi"]
    want = reference_logits(target_model, prompt + [g, *expected])[n + 5 :]
    torch.testing.assert_close(after, want, atol=ATOL, rtol=0)


def test_sampled_decode_items_choose_with_their_transforms_and_a_seed_per_position(
    target: Service, target_model: LoadedModel, prompts: list[list[int]]
) -> None:
    """A Decode item with sampling params gets tokens, not logits: at each position the
    transforms over the cached tokens, then a draw seeded from (seed, position), or the
    argmax at temperature 0. So five steps in one call equal five one-step calls, and each
    token is the reference model's choice at its position."""
    prompt = prompts[0]
    n, g = len(prompt), 17
    sampled = common_pb2.SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.2, seed=7)
    penalised = common_pb2.SamplingParams(repetition_penalty=3.0)  # greedy, with a penalty
    prefill(target, {"multi": prompt, "one": prompt, "greedy": prompt})
    response = target.stub.Verify(target_pb2.VerifyRequest(items=[
        target_pb2.VerifyItem(slot_id="multi", valid_len=n, tokens=[g], mode=decode_mode(5, sampled)),
        target_pb2.VerifyItem(slot_id="greedy", valid_len=n, tokens=[g], mode=decode_mode(4, penalised)),
    ]))
    multi, greedy = response.results
    assert multi.WhichOneof("answer") == "decoded" and multi.cached_len == n + 5 and greedy.cached_len == n + 4
    one_step = []
    for step in range(5):
        result = target.stub.Verify(target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(
            slot_id="one", valid_len=n + step, tokens=[([g] + one_step)[-1]], mode=decode_mode(1, sampled),
        )])).results[0]
        one_step.extend(result.decoded.ids)
    assert list(multi.decoded.ids) == one_step
    for params, chosen in ((sampled, list(multi.decoded.ids)), (penalised, list(greedy.decoded.ids))):
        request = sampling_from_pb(params)
        context = prompt + [g]
        for token in chosen:
            probs = logits_to_probs(reference_logits(target_model, context)[-1:], [request], [context])  # [1, vocab]
            seed = None if request.is_greedy or request.seed is None else independent_seed(request.seed, len(context))
            generator = None if seed is None else make_generator(seed, "cpu")
            assert token == int(pick_tokens(probs, [request], [generator])[0]), (params, context[n:])
            context.append(token)
    assert len(set(greedy.decoded.ids)) == len(greedy.decoded.ids)  # the penalty steers away from repeats


def sparse_q(rows: list[dict[int, float]]) -> common_pb2.SparseProbs:
    """q rows given as {token: weight} (weights need not sum to 1), as the draft sends them."""
    return sparse_to_pb(SparseRows(
        tuple(len(r) for r in rows), torch.tensor([t for r in rows for t in r]),
        torch.tensor([w for r in rows for w in r.values()]),
    ))


def test_sampled_speculative_items_get_candidates_and_p_at_the_draft_tokens(
    target: Service, target_model: LoadedModel, prompts: list[list[int]]
) -> None:
    """A Sampled item (sampling params and q) gets, instead of logits, p_i(t_i) for
    its K draft tokens and K + 1 candidates: draws from norm(max(0, p_i - q_i)) and from
    p_{K+1}, each seeded from (seed, position), p carrying the transforms with the
    penalties' context growing through the draft (presence and frequency counting from g,
    the first output token). Checked against the reference model; a second slot with the
    same request draws the same candidates."""
    prompt = prompts[1]
    n = len(prompt)
    g, *drafts = greedy_continuation(target_model, prompt, 4)  # likely tokens: p_i(t_i) mostly well above 0
    # The draft tokens themselves, each with a few other tokens: rows weighted unevenly.
    rows = [{t: 3.0, t + 1: 1.0, 500 + i: 0.5} for i, t in enumerate(drafts)]
    params = common_pb2.SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.2, seed=11, min_p=0.01,
                                       presence_penalty=0.5, frequency_penalty=0.4, penalty_start=n,
                                       logit_bias={drafts[1]: 1.5, 13: -2.0})
    prefill(target, {"a": prompt, "b": prompt})
    request = target_pb2.VerifyRequest(items=[
        target_pb2.VerifyItem(slot_id=slot, valid_len=n, tokens=[g, *drafts], mode=sampled_mode(params, sparse_q(rows)))
        for slot in ("a", "b")
    ])
    results = target.stub.Verify(request).results
    assert [r.cached_len for r in results] == [n + 4, n + 4]
    a, b = (result.sampled for result in results)
    assert len(a.candidates) == 4 and len(a.target_probs) == 3
    assert list(a.candidates) == list(b.candidates)
    # batched rows: another sum order
    torch.testing.assert_close(list(a.target_probs), list(b.target_probs), atol=1e-5, rtol=1e-4)
    assert max(a.target_probs) > 0.1

    sampling = sampling_from_pb(params)
    context = prompt + [g]
    p = chunk_logits_to_probs(reference_logits(target_model, context + drafts)[None, n:], [sampling], [context],
                              [drafts])[0]  # [4, vocab]
    torch.testing.assert_close(torch.tensor(list(a.target_probs)), token_probs(p[None], torch.tensor([drafts]))[0],
                               atol=1e-5, rtol=1e-4)
    q = sparse_from_pb(sparse_q(rows)).distributions(p.shape[-1], extra_rows=1)  # [4, vocab]
    generators = [make_generator(independent_seed(sampling.seed, n + 1 + i), "cpu") for i in range(4)]  # type: ignore[arg-type]
    assert list(a.candidates) == draw_candidates(p, q, generators).tolist()


def test_decoding_stops_early_when_the_call_deadline_is_near(target: Service, prompts: list[list[int]]) -> None:
    """With no time left the engine still decodes the first token of each item, then stops;
    each slot caches what it returned and decodes on from there."""
    prompt = prompts[2]
    n, g = len(prompt), 21
    prefill(target, {"late": prompt, "on_time": prompt})
    items = [VerifyItem(slot, n, [g], DecodeMode(4)) for slot in ("late", "on_time")]
    late = target.engine.verify(items[:1], deadline=time.monotonic())[0]
    on_time = target.engine.verify(items[1:], deadline=time.monotonic() + 60)[0]
    assert isinstance(late, VerifiedDecode) and isinstance(on_time, VerifiedDecode)
    assert late.tokens == on_time.tokens[:1] and late.cached_len == n + 1 and on_time.cached_len == n + 4
    rest = target.engine.verify([VerifyItem("late", n + 1, late.tokens[-1:], DecodeMode(3))])[0]
    assert isinstance(rest, VerifiedDecode) and late.tokens + rest.tokens == on_time.tokens


def test_verify_after_rollback_equals_verify_without_rejected_tokens(
    target: Service, target_model: LoadedModel, prompts: list[list[int]]
) -> None:
    prompt = prompts[2]
    n = len(prompt)
    prefill(target, {"rolled": prompt, "clean": prompt})
    # "rolled" sees a draft whose last three tokens get rejected; "clean" never sees them.
    verify(target, [("rolled", n, [500, 501, 502, 503]), ("clean", n, [500])])
    # Round 2: only g=500 was kept; both continue from n + 1 with the same chunk.
    logits = verify(target, [("rolled", n + 1, [600, 601, 602]), ("clean", n + 1, [600, 601, 602])])
    torch.testing.assert_close(logits["rolled"], logits["clean"], atol=ATOL, rtol=0)
    expected = reference_logits(target_model, prompt + [500, 600, 601, 602])[n + 1 :]
    torch.testing.assert_close(logits["rolled"], expected, atol=ATOL, rtol=0)


def test_batch_at_different_lengths_equals_each_request_alone(
    target: Service, prompts: list[list[int]]
) -> None:
    chunks = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10]]
    batched_prefill = prefill(target, {f"b{i}": p for i, p in enumerate(prompts)})
    batched_verify = verify(target, [(f"b{i}", len(p), c) for i, (p, c) in enumerate(zip(prompts, chunks))])
    for i, (prompt, chunk) in enumerate(zip(prompts, chunks)):
        alone_prefill = prefill(target, {f"a{i}": prompt})[f"a{i}"]
        alone_verify = verify(target, [(f"a{i}", len(prompt), chunk)])[f"a{i}"]
        torch.testing.assert_close(batched_prefill[f"b{i}"], alone_prefill, atol=ATOL, rtol=0)
        torch.testing.assert_close(batched_verify[f"b{i}"], alone_verify, atol=ATOL, rtol=0)


def test_truncate_rpc_then_verify(target: Service, target_model: LoadedModel, prompts: list[list[int]]) -> None:
    prompt = prompts[1]
    n = len(prompt)
    prefill(target, {"s": prompt + [900, 901, 902, 903]})
    assert truncate(target, "s", n) == n
    assert truncate(target, "s", n) == n  # truncating to the current length is a no-op
    logits = verify(target, [("s", n, [77, 78])])["s"]
    torch.testing.assert_close(logits, reference_logits(target_model, prompt + [77, 78])[n:], atol=ATOL, rtol=0)


def test_release_returns_every_block(target: Service, prompts: list[list[int]]) -> None:
    start = target.info()
    assert start.free_kv_tokens == start.total_kv_tokens
    prefill(target, {f"s{i}": p * 3 for i, p in enumerate(prompts)})
    verify(target, [(f"s{i}", len(p) * 3, list(range(30, 39))) for i, p in enumerate(prompts)])
    verify(target, [(f"s{i}", len(p) * 3 + 2, [5, 6]) for i, p in enumerate(prompts)])  # rollback 7
    truncate(target, "s0", 3)
    assert target.info().free_kv_tokens < start.free_kv_tokens
    for i in range(len(prompts)):
        release(target, f"s{i}")
    end = target.info()
    assert (end.free_kv_tokens, end.active_slots) == (start.free_kv_tokens, 0)
    check_pool(target.engine.cache.blocks, target.engine.tokens)


def test_a_repeated_prompt_is_served_from_the_prefix_cache(
    target: Service, target_model: LoadedModel, prompts: list[list[int]]
) -> None:
    prompt = prompts[2] * 3  # 57 tokens: three whole blocks and 9 more
    start, hits = target.info().free_kv_tokens, target.engine.prefix_cache_hits
    first = prefill(target, {"a": prompt})["a"]
    again = prefill(target, {"b": prompt})["b"]  # computes only the last 9 tokens
    assert target.engine.prefix_cache_hits - hits == 48
    torch.testing.assert_close(again, first, atol=ATOL, rtol=0)
    torch.testing.assert_close(again, reference_logits(target_model, prompt)[-1], atol=ATOL, rtol=0)
    assert target.info().free_kv_tokens == start - 5 * 16  # four blocks for a, one of b's own
    release(target, "a")
    release(target, "b")
    assert target.info().free_kv_tokens == start
    check_pool(target.engine.cache.blocks, target.engine.tokens)


def test_long_prompts_are_prefilled_in_chunks_with_the_same_logits(
    start_target: Callable[..., Service], target_model: LoadedModel, prompts: list[list[int]]
) -> None:
    """Chunks of 8 tokens: prompts of 57 and 19 tokens run as 8 and 3 forwards, after a
    prefix-cache hit too, and give transformers' logits; the slots cache what one forward would."""
    target = start_target(prefill_chunk_tokens=8)
    long, short = prompts[2] * 3, prompts[2]
    logits = prefill(target, {"a": long, "b": short})
    again = prefill(target, {"c": long})["c"]  # 48 tokens from the prefix cache, 9 in two chunks
    for got, tokens in ((logits["a"], long), (logits["b"], short), (again, long)):
        torch.testing.assert_close(got, reference_logits(target_model, tokens)[-1], atol=ATOL, rtol=0)
    n = len(long)
    after = verify(target, [("a", n, [5, 6, 7])])["a"]
    torch.testing.assert_close(after, reference_logits(target_model, long + [5, 6, 7])[n:], atol=ATOL, rtol=0)


def test_a_chunked_prefill_that_fails_frees_its_slots(
    start_target: Callable[..., Service], prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The third of a prompt's chunks fails: the batch's slots and blocks are freed, as after a
    one-forward failure, and the next prefill is served."""
    target = start_target(prefill_chunk_tokens=8)
    start = target.info().free_kv_tokens
    forward, calls = target.engine.model.forward, []

    def failing(*args: object) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of memory in chunk 3")
        return forward(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(target.engine.model, "forward", failing)
    error = rpc_error(target.stub.Prefill, target_pb2.PrefillRequest(items=[
        target_pb2.PrefillItem(slot_id="a", prompt_tokens=prompts[2] * 3),
        target_pb2.PrefillItem(slot_id="b", prompt_tokens=prompts[0]),
    ]))
    assert error.code() == grpc.StatusCode.INTERNAL and len(calls) == 3
    info = target.info()
    assert (info.active_slots, info.free_kv_tokens) == (0, start)
    check_pool(target.engine.cache.blocks, target.engine.tokens)
    prefill(target, {"a": prompts[0]})


def test_rolling_back_into_a_shared_block_copies_it(
    target: Service, target_model: LoadedModel, prompts: list[list[int]]
) -> None:
    """Slot b truncates into a block it shares with a and writes there: it writes to its own
    copy, and a's keys and values stay as they were."""
    prompt = prompts[2] * 3
    n = len(prompt)
    prefill(target, {"a": prompt})
    prefill(target, {"b": prompt})
    assert truncate(target, "b", 20) == 20  # inside the second shared block (positions 16-31)
    logits = verify(target, [("b", 20, [900, 901, 902]), ("a", n, [77, 78])])
    torch.testing.assert_close(logits["b"], reference_logits(target_model, prompt[:20] + [900, 901, 902])[20:],
                               atol=ATOL, rtol=0)
    torch.testing.assert_close(logits["a"], reference_logits(target_model, prompt + [77, 78])[n:], atol=ATOL, rtol=0)
    check_pool(target.engine.cache.blocks, target.engine.tokens)
    c = prefill(target, {"c": prompt})["c"]  # a's blocks are still the prompt's
    torch.testing.assert_close(c, reference_logits(target_model, prompt)[-1], atol=ATOL, rtol=0)


def test_without_prefix_caching_every_prompt_is_computed(
    start_target: Callable[..., Service], prompts: list[list[int]]
) -> None:
    target = start_target(prefix_caching=False)
    prefill(target, {"a": prompts[2] * 3, "b": prompts[2] * 3})
    assert target.engine.prefix_cache_hits == 0
    assert target.engine.cache.blocks.cached_prefix(prompts[2] * 3) == []


def test_many_slots_at_once(start_target: Callable[..., Service], target_model: LoadedModel) -> None:
    """24 slots prefilled in one batch, then decoded (K = 0) in one batch, then all released."""
    service = start_target(max_slots=24, kv_token_budget=24 * 32)
    slots = {f"m{i:02d}": [(7 * i + j) % 4000 + 10 for j in range(3 + i % 9)] for i in range(24)}
    last = prefill(service, slots)
    assert service.info().active_slots == 24
    decoded = verify(service, [(s, len(p), [int(last[s].argmax())]) for s, p in slots.items()])
    for slot in ("m00", "m07", "m23"):  # spot-check against the reference
        prompt = slots[slot]
        expected = reference_logits(target_model, prompt + [int(last[slot].argmax())])[len(prompt) :]
        torch.testing.assert_close(decoded[slot], expected, atol=ATOL, rtol=0)
    for slot in slots:
        release(service, slot)
    info = service.info()
    assert (info.free_kv_tokens, info.active_slots) == (info.total_kv_tokens, 0)


def test_health_check_answers_while_prefill_runs_on_the_worker(target: Service, prompts: list[list[int]]) -> None:
    """While the model worker is busy inside Prefill, the event loop still serves health checks and Info."""
    engine = target.engine
    started, finish = threading.Event(), threading.Event()
    real_prefill = engine.prefill

    def slow_prefill(items, lease=None):  # type: ignore[no-untyped-def]
        started.set()
        finish.wait(timeout=60)
        return real_prefill(items, lease)

    engine.prefill = slow_prefill  # type: ignore[method-assign]
    request = target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(slot_id="long", prompt_tokens=prompts[2])])
    pending = target.stub.Prefill.future(request)
    try:
        assert started.wait(timeout=30), "Prefill never reached the worker"
        # Deadlines well inside the worker's stall (until `finish`, up to a minute): an answer
        # queued behind the Prefill would miss them, a loaded machine does not.
        for service in ("", SERVICE_NAME):
            reply = target.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=20)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert target.stub.Info(common_pb2.InfoRequest(), timeout=20).vocab_size == 49_152
        assert not pending.done()
    finally:
        finish.set()
    assert pending.result().results[0].cached_len == len(prompts[2])


# -- error statuses -------------------------------------------------------------------------


def test_unknown_slot_is_not_found(target: Service) -> None:
    calls = [
        (target.stub.Verify, target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(slot_id="nope", tokens=[1])])),
        (target.stub.Truncate, common_pb2.TruncateRequest(slot_id="nope", new_len=0)),
        (target.stub.Release, common_pb2.ReleaseRequest(slot_id="nope")),
    ]
    for call, request in calls:
        error = rpc_error(call, request)
        assert error.code() == grpc.StatusCode.NOT_FOUND
        assert "nope" in error.details()


def test_an_empty_slot_id_is_invalid_argument_on_every_rpc(target: Service) -> None:
    """The same mistake gets the same code whichever rpc makes it."""
    calls = [
        (target.stub.Prefill, target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(slot_id="", prompt_tokens=[1])])),
        (target.stub.Verify, target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(slot_id="", tokens=[1])])),
        (target.stub.Truncate, common_pb2.TruncateRequest(slot_id="", new_len=0)),
        (target.stub.Release, common_pb2.ReleaseRequest(slot_id="")),
    ]
    for call, request in calls:
        error = rpc_error(call, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, call
        assert "slot_id" in error.details()


def test_existing_slot_on_prefill_is_already_exists_and_the_batch_changes_nothing(
    target: Service, target_model: LoadedModel, prompts: list[list[int]]
) -> None:
    prefill(target, {"a": prompts[0]})
    before = target.info()
    request = target_pb2.PrefillRequest(
        items=[
            target_pb2.PrefillItem(slot_id="fresh", prompt_tokens=prompts[1]),
            target_pb2.PrefillItem(slot_id="a", prompt_tokens=prompts[2]),
        ]
    )
    error = rpc_error(target.stub.Prefill, request)
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS and "'a'" in error.details()
    after = target.info()
    assert (after.free_kv_tokens, after.active_slots) == (before.free_kv_tokens, before.active_slots)
    assert (rpc_error(target.stub.Release, common_pb2.ReleaseRequest(slot_id="fresh")).code()
            == grpc.StatusCode.NOT_FOUND)
    n = len(prompts[0])
    logits = verify(target, [("a", n, [5])])["a"]  # "a" still holds its prompt
    torch.testing.assert_close(logits, reference_logits(target_model, prompts[0] + [5])[n:], atol=ATOL, rtol=0)


def test_kv_pool_full_is_resource_exhausted_and_frees_nothing_of_others(
    start_target: Callable[..., Service], target_model: LoadedModel
) -> None:
    service = start_target(kv_token_budget=64)  # 4 blocks of 16
    a, b = list(range(1000, 1030)), list(range(2000, 2030))  # 30 tokens = 2 blocks each
    prefill(service, {"a": a})
    # Prefill: 2 blocks free, the batch needs 3.
    request = target_pb2.PrefillRequest(
        items=[target_pb2.PrefillItem(slot_id="x", prompt_tokens=b[:10]),
               target_pb2.PrefillItem(slot_id="y", prompt_tokens=b)]
    )
    error = rpc_error(service.stub.Prefill, request)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(error.trailing_metadata())[CAPACITY_TRAILER] == "kv_blocks"  # retryable: a gateway queues
    info = service.info()
    assert (info.free_kv_tokens, info.active_slots) == (32, 1)
    prefill(service, {"b": b})  # the pool is now full
    # Verify: a needs a third block, none is free.
    error = rpc_error(
        service.stub.Verify,
        target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(slot_id="a", valid_len=30, tokens=[1, 2, 3])]),
    )
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert service.info().free_kv_tokens == 0
    # Decode: the first forward fits (b's second block has room), a later step does not;
    # the whole batch is undone, a's and b's valid tokens included.
    error = rpc_error(service.stub.Verify, target_pb2.VerifyRequest(items=[
        target_pb2.VerifyItem(slot_id="b", valid_len=30, tokens=[8], mode=decode_mode(4)),
    ]))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert service.info().free_kv_tokens == 0 and truncate(service, "b", 30) == 30
    # Neither slot lost anything: both still score their next token correctly.
    logits = verify(service, [("a", 30, [7]), ("b", 30, [8])])
    torch.testing.assert_close(logits["a"], reference_logits(target_model, a + [7])[30:], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits["b"], reference_logits(target_model, b + [8])[30:], atol=ATOL, rtol=0)


def test_slot_table_full_is_resource_exhausted(start_target: Callable[..., Service]) -> None:
    service = start_target(max_slots=2)
    prefill(service, {"a": [1, 2]})
    request = target_pb2.PrefillRequest(
        items=[target_pb2.PrefillItem(slot_id=s, prompt_tokens=[3, 4]) for s in ("b", "c")]
    )
    error = rpc_error(service.stub.Prefill, request)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "slots" in error.details()
    assert dict(error.trailing_metadata())[CAPACITY_TRAILER] == "slots"
    assert service.info().active_slots == 1


def test_invalid_arguments_name_the_field(start_target: Callable[..., Service]) -> None:
    service = start_target(max_seq_len=40, max_speculative_tokens=4)
    prefill(service, {"a": list(range(10, 30))})  # 20 cached tokens
    vocab = service.info().vocab_size

    def prefill_request(*items: tuple[str, list[int]]) -> target_pb2.PrefillRequest:
        return target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(slot_id=s, prompt_tokens=p) for s, p in items])

    def verify_request(valid_len: int, tokens: list[int]) -> target_pb2.VerifyRequest:
        return target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(slot_id="a", valid_len=valid_len, tokens=tokens)])

    def decode_request(tokens: list[int], steps: int, temperature: float = 0.0,
                       **options: object) -> target_pb2.VerifyRequest:
        sampling = common_pb2.SamplingParams(temperature=temperature, **options)
        return target_pb2.VerifyRequest(items=[
            target_pb2.VerifyItem(slot_id="a", valid_len=20, tokens=tokens, mode=decode_mode(steps, sampling))
        ])

    def q_request(tokens: list[int], rows: list[dict[int, float]], **options: object) -> target_pb2.VerifyRequest:
        mode = sampled_mode(common_pb2.SamplingParams(temperature=0.5, **options), sparse_q(rows))
        return target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(slot_id="a", valid_len=20, tokens=tokens,
                                                                     mode=mode)])

    duplicate = q_request([1, 2], [{2: 1.0}])
    duplicate_q = duplicate.items[0].mode.sampled.draft_probs
    duplicate_q.row_lengths[0] = 2
    duplicate_q.token_ids.append(2)
    duplicate_q.values.CopyFrom(encode_tensor(torch.tensor([1.0, 1.0])))
    cases = [
        (service.stub.Verify, duplicate, "draft_probs"),
        (service.stub.Prefill, target_pb2.PrefillRequest(), "items"),
        (service.stub.Prefill, prefill_request(("new", [])), "prompt_tokens"),
        (service.stub.Prefill, prefill_request(("new", [1, vocab])), "prompt_tokens"),
        (service.stub.Prefill, prefill_request(("new", [1, -1])), "prompt_tokens"),
        (service.stub.Prefill, prefill_request(("", [1])), "slot_id"),
        (service.stub.Prefill, prefill_request(("dup", [1]), ("dup", [2])), "slot_id"),
        (service.stub.Prefill, prefill_request(("new", list(range(41)))), ("prompt_tokens", "max_seq_len")),
        (service.stub.Verify, target_pb2.VerifyRequest(), "items"),
        (service.stub.Verify, verify_request(21, [1]), "valid_len"),
        (service.stub.Verify, verify_request(20, []), "tokens"),
        (service.stub.Verify, verify_request(20, [1, 2, 3, 4, 5, 6]), "max_speculative_tokens"),  # K = 5 > 4
        (service.stub.Verify, verify_request(20, [1, vocab + 5]), "tokens"),
        (service.stub.Verify, verify_request(20, [-3]), "tokens"),
        (service.stub.Verify, decode_request([1, 2], steps=2), "mode"),  # decoding on after a draft token
        (service.stub.Verify, decode_request([1], steps=0), "steps"),
        (service.stub.Verify, decode_request([1], steps=6), ("steps", "max_speculative_tokens")),
        (service.stub.Verify, decode_request([1], steps=1, temperature=-1.0), "temperature"),
        (service.stub.Verify, q_request([1, 2, 3], [{2: 1.0}]), "draft_probs"),  # 1 row for K = 2
        (service.stub.Verify, q_request([1, 2], [{3: 1.0}]), "draft_probs"),  # t_1 outside its row's support
        (service.stub.Verify, q_request([1, 2], [{2: 1.0, vocab: 1.0}]), "draft_probs"),
        (service.stub.Verify, q_request([1, 2], [{2: -1.0, 3: 2.0}]), "draft_probs"),
        (service.stub.Verify, q_request([1], []), "mode"),  # sampled without draft tokens
        (service.stub.Verify, q_request([1, 2], [{2: 1.0}], logit_bias={vocab: 1.0}), "sampling.logit_bias"),
        (service.stub.Verify, decode_request([1], steps=1, logit_bias={vocab: 1.0}), "sampling.logit_bias"),
        (service.stub.Verify, decode_request([1], steps=1, min_p=2.0), "min_p"),
        (service.stub.Truncate, common_pb2.TruncateRequest(slot_id="a", new_len=21), "new_len"),
        (service.stub.Truncate, common_pb2.TruncateRequest(slot_id="a", new_len=-1), "new_len"),
    ]
    for call, request, fields in cases:
        error = rpc_error(call, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (request, error.details())
        for field in (fields,) if isinstance(fields, str) else fields:
            assert field in error.details(), (field, error.details())
    # Verify past max_seq_len: 36 cached + 5 new = 41 > 40 (K = 4 is allowed).
    prefill(service, {"long": list(range(36))})
    error = rpc_error(service.stub.Verify, target_pb2.VerifyRequest(
        items=[target_pb2.VerifyItem(slot_id="long", valid_len=36, tokens=[1, 2, 3, 4, 5])]
    ))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tokens" in error.details() and "max_seq_len" in error.details()
    # Decoding past max_seq_len: 36 cached + 5 decoded (the last one not cached) = 41 > 40.
    error = rpc_error(service.stub.Verify, target_pb2.VerifyRequest(
        items=[target_pb2.VerifyItem(slot_id="long", valid_len=36, tokens=[1], mode=decode_mode(5))]
    ))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_seq_len" in error.details()
    # None of the failures touched "a": it still holds its 20 tokens.
    assert truncate(service, "a", 20) == 20
    assert service.info().active_slots == 2


def test_failed_verify_batch_changes_no_slot(
    target: Service, target_model: LoadedModel, prompts: list[list[int]]
) -> None:
    """Validation runs before any rollback: a bad item fails the batch and the good slot keeps its tokens."""
    prompt = prompts[0]
    n = len(prompt)
    prefill(target, {"good": prompt})
    verify(target, [("good", n, [40, 41, 42])])  # cached n + 3
    free_before = target.info().free_kv_tokens
    error = rpc_error(target.stub.Verify, target_pb2.VerifyRequest(items=[
        target_pb2.VerifyItem(slot_id="good", valid_len=n, tokens=[1]),  # would roll back 3 tokens
        target_pb2.VerifyItem(slot_id="missing", valid_len=0, tokens=[1]),
    ]))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert target.info().free_kv_tokens == free_before
    logits = verify(target, [("good", n + 3, [43])])["good"]  # the 3 tokens are still cached
    expected = reference_logits(target_model, prompt + [40, 41, 42, 43])[n + 3 :]
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_a_bug_is_internal_and_the_server_keeps_serving(target: Service, caplog: pytest.LogCaptureFixture) -> None:
    def broken(slot_id: str, new_len: int) -> int:
        raise RuntimeError("secret detail")

    target.engine.truncate = broken  # type: ignore[method-assign]
    error = rpc_error(target.stub.Truncate, common_pb2.TruncateRequest(slot_id="a", new_len=0))
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in error.details()  # the traceback goes to the log, not the client
    assert any("secret detail" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)
    assert target.info().active_slots == 0


def test_results_are_encoded_on_the_model_worker_not_the_event_loop(
    target: Service, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy of the logits to the host waits for the forward: it runs where the forward
    ran, on the model worker, and the event loop only sends the finished message."""
    threads: list[str] = []

    def recording(name: str, encode: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            threads.append(f"{name} on {threading.current_thread().name}")
            return encode(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(wire_items, "encode_tensor", recording("encode_tensor", wire_items.encode_tensor))
    monkeypatch.setattr(target_servicer, "verified_to_pb", recording("verified_to_pb", target_servicer.verified_to_pb))
    prompt = prompts[0]
    prefill(target, {"a": prompt})
    verify(target, [("a", len(prompt), [5, 6])])
    worker = SERVICE_NAME.rsplit(".", 1)[-1]  # the model worker's thread name prefix
    assert len(threads) == 3 and all(record.split(" on ")[1].startswith(worker) for record in threads), threads


def test_a_row_with_nothing_to_draw_fails_its_call_clearly_and_the_next_one_works(
    target: Service, prompts: list[list[int]]
) -> None:
    """A temperature so small that every logit overflows leaves a row of NaN probabilities:
    the host copy of the tokens refuses it with INVALID_ARGUMENT (a device-side assert would
    end the process's CUDA context), the slot rolls back, and the service serves on."""
    prompt = prompts[0]
    n = len(prompt)
    prefill(target, {"a": prompt})
    tiny = common_pb2.SamplingParams(temperature=1e-40, seed=3)  # a float32 subnormal: every logit / it is ±inf
    error = rpc_error(target.stub.Verify, target_pb2.VerifyRequest(items=[
        target_pb2.VerifyItem(slot_id="a", valid_len=n, tokens=[17], mode=decode_mode(1, tiny)),
    ]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no distribution to draw from" in error.details() and "temperature" in error.details()
    normal = common_pb2.SamplingParams(temperature=0.8, seed=3)
    result = target.stub.Verify(target_pb2.VerifyRequest(items=[
        target_pb2.VerifyItem(slot_id="a", valid_len=n, tokens=[17], mode=decode_mode(2, normal)),
    ])).results[0]
    assert result.cached_len == n + 2 and len(result.decoded.ids) == 2


# -- grammar masks --------------------------------------------------------------------------


def _masks(rows: list[list[int]], vocab: int) -> common_pb2.TokenMasks:
    """TokenMasks allowing exactly `rows[r]` at row r."""
    allowed = torch.zeros(len(rows), vocab, dtype=torch.bool)
    for r, tokens in enumerate(rows):
        allowed[r, tokens] = True
    return token_masks_to_pb(TokenMasks.from_allowed(allowed))


def test_masked_items_choose_among_the_allowed_tokens_and_keep_raw_logprobs(
    target: Service, prompts: list[list[int]], target_model: LoadedModel
) -> None:
    """Argmax and Decode items under a mask answer each row's best allowed token; raw logprobs are
    the model's own (the unmasked softmax), the Logits item's logits stay raw."""
    vocab = target_model.model.config.vocab_size
    prefill(target, {"raw": prompts[0], "arg": prompts[0], "dec": prompts[1]})
    chunk, n = [11, 300, 301], len(prompts[0])
    raw = verify(target, [("raw", n, chunk)])["raw"]  # [3, vocab]
    allowed = [[5, 6, 7], [100, 200], [42]]
    logprobs = target_pb2.VerifyMode(argmax=target_pb2.VerifyMode.Argmax(logprobs=target_pb2.LogprobsRequest(top=1)))
    response = target.stub.Verify(target_pb2.VerifyRequest(items=[
        target_pb2.VerifyItem(slot_id="arg", valid_len=n, tokens=chunk, mode=logprobs, allowed=_masks(allowed, vocab)),
        target_pb2.VerifyItem(slot_id="dec", valid_len=len(prompts[1]), tokens=[11], allowed=_masks([[9, 10]], vocab),
                              mode=target_pb2.VerifyMode(decode=target_pb2.VerifyMode.Decode(steps=1))),
    ]))
    arg, dec = response.results
    want = [tokens[int(raw[r, tokens].argmax())] for r, tokens in enumerate(allowed)]
    assert list(arg.argmax.ids) == want
    model_logprobs = torch.log_softmax(raw.double(), dim=-1)
    assert list(arg.logprobs.answered) == pytest.approx(
        [float(model_logprobs[r, t]) for r, t in enumerate(want)], abs=1e-4)
    assert list(dec.decoded.ids)[0] in (9, 10)


@pytest.mark.parametrize(("rows", "steps", "field"), [
    ([[1], [2]], None, "allowed"),       # 2 rows for 3
    ([[1]], 2, "steps"),                 # a mask covers one decoded step
    ([[], [1], [2]], None, "allowed"),   # a row that allows nothing
])
def test_a_mask_that_does_not_fit_the_item_is_invalid_argument(
    target: Service, prompts: list[list[int]], target_model: LoadedModel, rows: list[list[int]], steps: int | None,
    field: str,
) -> None:
    prefill(target, {"s": prompts[0]})
    tokens = [11] if steps else [11, 300, 301]
    mode = target_pb2.VerifyMode(decode=target_pb2.VerifyMode.Decode(steps=steps)) if steps else ARGMAX
    item = target_pb2.VerifyItem(slot_id="s", valid_len=len(prompts[0]), tokens=tokens, mode=mode,
                                 allowed=_masks(rows, target_model.model.config.vocab_size))
    with pytest.raises(grpc.RpcError) as raised:
        target.stub.Verify(target_pb2.VerifyRequest(items=[item]))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (raised.value.details() or "").startswith(field), raised.value.details()


def test_a_gateway_that_misses_a_verify_hold_is_backed_off_one_hold_only(target: Service) -> None:
    """Every gateway with target slots verifies every round: one that misses a hold is late, not
    absent, and a back-off that doubled let two gateways settle into turns."""
    stats = ServiceStats("target", ["Verify"], ["Verify"])
    worker = SerialExecutor("test-target-backoff")
    assert isinstance(target.engine, TargetEngine)
    try:
        merger = target_servicer.TargetServicer(target.engine, worker, stats).verifies
    finally:
        worker.shutdown()
    assert merger.max_wait_s == target.engine.config.merge_wait_s > 0
    assert merger.first_backoff_s == merger.max_backoff_s == merger.max_wait_s
