"""Fuzzing the request messages of all three services with hypothesis.

Each example sends one generated message — mostly well-formed, with one or more fields
pushed to the edge (empty or odd slot ids, token ids outside the vocabulary, lengths past
the cache, K of 0 or 1000, NaN and infinite sampling settings, unknown chat roles, long
stop lists, 10**9 new tokens) — to a real server on loopback, and then checks:

* the call succeeded, or failed with a clear code (never UNKNOWN, INTERNAL or a hang) and
  a non-empty message;
* the server's health check still answers SERVING;
* once the example's own slots are released, nothing is left: no slot held and every
  KV block free, in both services.

Examples are derandomized, so CI runs the same ones every time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.client import SpecdecClient
from specdec.model.runtime import ModelRuntime
from specdec.v1 import common_pb2, draft_pb2, gateway_pb2, target_pb2
from tests.support.services import RPC_TIMEOUT_S, Service, StartService
from tests.support.stacks import StartStack

VOCAB = 49152
#: The codes a bad request may get: each names what was wrong.
CLEAR_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
}
FUZZ = settings(
    derandomize=True, deadline=None, database=None, max_examples=60,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
KNOWN = "known"  # a slot each service example starts with, so rollbacks and verifies go deep

# Mostly ids that exist or may be created, so that most examples get past the slot checks.
slot_ids = st.sampled_from([KNOWN, KNOWN, "fresh", "fresh", "other", "", "x" * 300, "ü🙂\x00"]) | st.text(max_size=12)
token_ids = st.sampled_from([0, 1, VOCAB - 1, VOCAB, -1, 2**31 - 1, -(2**31)]) | st.integers(0, VOCAB - 1)
tokens = st.lists(token_ids, min_size=1, max_size=10) | st.just([])
lengths = st.sampled_from([0, 1, 2, 3, 3, 4, -1, 1000, 2**31 - 1]) | st.integers(-3, 12)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32) | st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0])
sampling = st.builds(
    common_pb2.SamplingParams, temperature=floats, top_k=st.integers(-5, 100_000), top_p=floats,
    repetition_penalty=floats, seed=st.none() | st.integers(0, 2**64 - 1),
)


def _call(call: Callable[[], Any]) -> grpc.StatusCode:
    """The call's status code; a failure must carry a message."""
    try:
        call()
    except grpc.RpcError as error:
        assert error.code() in CLEAR_CODES, f"{error.code().name}: {error.details()}"
        assert error.details(), f"{error.code().name} without a message"
        return error.code()
    return grpc.StatusCode.OK


def _check_clean(service: Service) -> None:
    """Release every slot the example left (its own, by design), then nothing may be held."""
    assert (service.health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
            == health_pb2.HealthCheckResponse.SERVING)
    for slot_id in list(service.engine.tokens):
        service.stub.Release(common_pb2.ReleaseRequest(slot_id=slot_id))
    info = service.info()
    assert info.active_slots == 0 and info.free_kv_tokens == info.total_kv_tokens


def _fuzz_service(service: Service, calls: st.SearchStrategy[tuple[str, Any]], create_known: Callable[[], Any]) -> None:
    """Each example: make sure the KNOWN slot exists, send one generated call, check the aftermath."""

    @FUZZ
    @given(calls)
    def check(call: tuple[str, Any]) -> None:
        method, request = call
        if KNOWN not in service.engine.tokens:
            create_known()
        _call(lambda: getattr(service.stub, method)(request, timeout=RPC_TIMEOUT_S))
        _check_clean(service)

    check()


# -- target -----------------------------------------------------------------------------------

prefill_items = st.lists(st.builds(target_pb2.PrefillItem, slot_id=slot_ids, prompt_tokens=tokens), max_size=3)
verify_items = st.lists(st.builds(target_pb2.VerifyItem, slot_id=slot_ids, valid_len=lengths, tokens=tokens),
                        max_size=3)
leases = st.builds(common_pb2.Lease, holder=st.text(max_size=8), incarnation=st.text(max_size=8))
target_calls = st.one_of(
    st.tuples(st.just("Prefill"), st.builds(target_pb2.PrefillRequest, items=prefill_items, lease=leases)),
    st.tuples(st.just("Verify"), st.builds(target_pb2.VerifyRequest, items=verify_items)),
    st.tuples(st.just("Truncate"), st.builds(common_pb2.TruncateRequest, slot_id=slot_ids, new_len=lengths)),
    st.tuples(st.just("Release"), st.builds(common_pb2.ReleaseRequest, slot_id=slot_ids)),
    st.tuples(st.just("RenewLease"), st.builds(common_pb2.RenewLeaseRequest, lease=leases)),
)


def test_fuzz_target_requests(start_target: StartService) -> None:
    target = start_target(kv_token_budget=256, max_slots=4, max_speculative_tokens=4)
    known = target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(slot_id=KNOWN, prompt_tokens=[1, 2, 3])])
    _fuzz_service(target, target_calls, lambda: target.stub.Prefill(known))


# -- draft ------------------------------------------------------------------------------------

propose_items = st.lists(
    st.builds(draft_pb2.ProposeItem, slot_id=slot_ids, valid_len=lengths, new_tokens=tokens,
              num_speculative_tokens=st.sampled_from([0, 1, 2, 4, 5, -1, 1000]), sampling=sampling),
    max_size=3,
)
draft_calls = st.one_of(
    st.tuples(st.just("Propose"), st.builds(
        draft_pb2.ProposeRequest, items=propose_items, probs_dtype=st.sampled_from([0, 1, 2, 3, 7]), lease=leases,
    )),
    st.tuples(st.just("Truncate"), st.builds(common_pb2.TruncateRequest, slot_id=slot_ids, new_len=lengths)),
    st.tuples(st.just("Release"), st.builds(common_pb2.ReleaseRequest, slot_id=slot_ids)),
    st.tuples(st.just("RenewLease"), st.builds(common_pb2.RenewLeaseRequest, lease=leases)),
)


def test_fuzz_draft_requests(start_draft: StartService) -> None:
    draft = start_draft(kv_token_budget=256, max_slots=4, max_speculative_tokens=4)
    known = draft_pb2.ProposeRequest(items=[draft_pb2.ProposeItem(slot_id=KNOWN, new_tokens=[1, 2, 3],
                                                                  num_speculative_tokens=1)])
    _fuzz_service(draft, draft_calls, lambda: draft.stub.Propose(known))


# -- gateway ----------------------------------------------------------------------------------

roles = st.sampled_from(["user", "system", "assistant", "tool", "", "bogus", "USER"])
chats = st.builds(gateway_pb2.ChatMessages, messages=st.lists(
    st.builds(gateway_pb2.ChatMessage, role=roles, content=st.text(max_size=40)), max_size=3,
))
generate_requests = st.builds(
    gateway_pb2.GenerateRequest,
    prompt=st.none() | st.text(max_size=60),
    chat=st.none() | chats,
    max_new_tokens=st.sampled_from([-1, 0, 1, 3, 10**9]),
    sampling=sampling,
    stop=st.lists(st.text(max_size=300), max_size=18),
    speculation=st.builds(
        gateway_pb2.SpeculationOptions, enabled=st.none() | st.booleans(),
        num_speculative_tokens=st.none() | st.sampled_from([-1, 0, 1, 4, 9, 1000]), adaptive=st.none() | st.booleans(),
    ),
)


def test_fuzz_gateway_requests(start_stack: StartStack, int8_runtime: ModelRuntime) -> None:
    # Short sequences keep 10**9-token requests quick: the gateway caps them at max_seq_len.
    short = dict(kv_token_budget=512, max_seq_len=48)
    stack = start_stack(int8_runtime, target=short, draft=short, default_max_new_tokens=3)
    client = SpecdecClient(stack.address, timeout=60)

    @settings(FUZZ, max_examples=40)
    @given(generate_requests)
    def check(request: gateway_pb2.GenerateRequest) -> None:
        outcome = _call(lambda: list(client.stub.Generate(request, timeout=60)))
        if outcome == grpc.StatusCode.OK:
            assert _call(client.info) == grpc.StatusCode.OK
        stack.wait_until_idle()
        for engine in stack.engines():
            assert engine.cache.blocks.free_tokens == engine.cache.capacity_tokens

    try:
        check()
    finally:
        client.close()
