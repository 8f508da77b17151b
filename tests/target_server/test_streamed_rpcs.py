"""The streamed work rpcs on real servers: VerifyStream and ProposeStream answer each request
as the unary rpc would, an error ends the stream with its status, a stopping service ends
idle streams at once; and the gateway's `StreamedRpc` keeps one stream, never hands a
request the answer of an abandoned one, and fails as a unary call would."""

from __future__ import annotations

import asyncio
import queue
import typing
from collections.abc import Iterator

import grpc
import pytest

from specdec.gateway.model_clients import DraftClient, ServiceLink, TargetClient
from specdec.gateway.streamed_rpc import StreamedRpc
from specdec.model.loader import LoadedModel
from specdec.model.runtime import ModelRuntime
from specdec.sampling.params import SamplingParams
from specdec.v1 import common_pb2, draft_pb2, target_pb2, target_pb2_grpc
from specdec.wire.items import ArgmaxMode, DecodeMode, Lease, PrefillItem, ProposeItem, VerifiedArgmax, VerifyItem
from specdec.wire.limits import DEFAULT_MAX_MESSAGE_BYTES
from tests.support.services import RPC_TIMEOUT_S, SMALL_POOL, LoopThread, Service, slow_down, target_server

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def prompt(target_model: LoadedModel) -> list[int]:
    return target_model.tokenizer.encode("Once upon a time, in a small village by the sea, there lived")


def _prefill(service: Service, slots: list[str], prompt: list[int]) -> None:
    items = [target_pb2.PrefillItem(slot_id=slot, prompt_tokens=prompt) for slot in slots]
    service.stub.Prefill(target_pb2.PrefillRequest(items=items))


def _verify_request(slot: str, valid_len: int, tokens: list[int]) -> target_pb2.VerifyRequest:
    mode = target_pb2.VerifyMode(argmax=target_pb2.VerifyMode.Argmax())
    item = target_pb2.VerifyItem(slot_id=slot, valid_len=valid_len, tokens=tokens, mode=mode)
    return target_pb2.VerifyRequest(items=[item])


def _chunks(prompt: list[int]) -> list[tuple[int, list[int]]]:
    """Three verifies in a row on a slot that holds `prompt`: (valid_len, tokens)."""
    n = len(prompt)
    return [(n, [11, 12, 13]), (n + 2, [21, 22]), (n + 1, [31])]  # each rolls back part of the last


def test_verify_stream_answers_each_request_in_order_as_verify_does(target: Service, prompt: list[int]) -> None:
    _prefill(target, ["streamed", "unary"], prompt)
    streamed = list(target.stub.VerifyStream(iter([_verify_request("streamed", v, t) for v, t in _chunks(prompt)]),
                                             timeout=60))
    unary = [target.stub.Verify(_verify_request("unary", v, t)) for v, t in _chunks(prompt)]
    assert len(streamed) == 3
    for got, expected in zip(streamed, unary):
        assert list(got.results[0].argmax.ids) == list(expected.results[0].argmax.ids)
        assert got.results[0].cached_len == expected.results[0].cached_len
        assert got.compute_s > 0


def test_an_error_ends_the_stream_with_the_status_verify_answers(target: Service, prompt: list[int]) -> None:
    _prefill(target, ["known"], prompt)
    requests = [_verify_request("known", len(prompt), [5]), _verify_request("unknown", 0, [5]),
                _verify_request("known", len(prompt), [6])]
    responses = target.stub.VerifyStream(iter(requests), timeout=60)
    assert next(responses).results[0].cached_len == len(prompt) + 1
    with pytest.raises(grpc.RpcError) as error:
        next(responses)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert responses.code() == grpc.StatusCode.NOT_FOUND  # the stream ended there: the third is never answered


@pytest.mark.parametrize("timeout_s", [-1.0, float("nan"), float("inf")])
def test_a_timeout_that_is_not_a_duration_is_invalid_argument(
    target: Service, prompt: list[int], timeout_s: float
) -> None:
    _prefill(target, ["t"], prompt)
    request = _verify_request("t", len(prompt), [5])
    request.timeout_s = timeout_s
    with pytest.raises(grpc.RpcError) as error:
        target.stub.Verify(request)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "timeout_s" in (error.value.details() or "")
    request.timeout_s = 30.0
    assert target.stub.Verify(request).results[0].cached_len == len(prompt) + 1  # the slot is untouched


def test_propose_stream_answers_each_request_as_propose_does(draft: Service, prompt: list[int]) -> None:
    def request(slot: str, valid_len: int, new_tokens: list[int]) -> draft_pb2.ProposeRequest:
        item = draft_pb2.ProposeItem(slot_id=slot, valid_len=valid_len, new_tokens=new_tokens, num_speculative_tokens=3,
                                     sampling=common_pb2.SamplingParams(temperature=0.0))
        return draft_pb2.ProposeRequest(items=[item])

    rounds = [(0, prompt), (len(prompt), [7, 8])]
    streamed = list(draft.stub.ProposeStream(iter([request("streamed", v, t) for v, t in rounds]), timeout=60))
    unary = [draft.stub.Propose(request("unary", v, t)) for v, t in rounds]
    assert [list(r.results[0].tokens) for r in streamed] == [list(r.results[0].tokens) for r in unary]
    assert len(streamed) == 2 and all(len(r.results[0].tokens) == 3 for r in streamed)


def test_stopping_the_service_ends_an_idle_stream_at_once(
    service_loop: LoopThread, fp32_runtime: ModelRuntime, prompt: list[int]
) -> None:
    """A connected gateway's open stream must not hold a graceful stop for its whole grace."""
    server = service_loop.run(target_server(fp32_runtime, **SMALL_POOL)[1])
    pending: queue.Queue[target_pb2.VerifyRequest | None] = queue.Queue()

    def requests() -> Iterator[target_pb2.VerifyRequest]:
        while (request := pending.get()) is not None:
            yield request

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        stub.Prefill(target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(slot_id="s", prompt_tokens=prompt)]),
                     timeout=60)
        responses = stub.VerifyStream(requests(), timeout=60)
        pending.put(_verify_request("s", len(prompt), [5]))
        assert next(responses).results[0].cached_len == len(prompt) + 1
        # A stop that waited out its grace would outlast the loop call's RPC_TIMEOUT_S and fail here.
        service_loop.run(server.stop(grace=10 * RPC_TIMEOUT_S))
        with pytest.raises(StopIteration):  # ended with status OK, not cancelled at the grace's end
            next(responses)
        pending.put(None)


# -- the gateway's side: StreamedRpc through TargetClient / DraftClient ---------------------


def _clients(
    service_loop: LoopThread, target_port: int, draft_port: int | None = None
) -> tuple[TargetClient, DraftClient | None]:
    """The gateway's clients (kept streams, the default) of the services on these ports."""

    async def make() -> tuple[TargetClient, DraftClient | None]:  # channels belong to the loop that uses them
        link = ServiceLink(DEFAULT_MAX_MESSAGE_BYTES)
        lease = Lease("streams-test", "1")
        draft_client = (DraftClient(f"127.0.0.1:{draft_port}", link, common_pb2.DTYPE_FLOAT32, lease)
                        if draft_port else None)
        return TargetClient(f"127.0.0.1:{target_port}", link, lease), draft_client

    return service_loop.run(make())


def _close(service_loop: LoopThread, *clients: TargetClient | DraftClient | None) -> None:
    for client in clients:
        if client is not None:
            service_loop.run(client.close())


def test_streamed_verify_keeps_one_stream_and_gets_the_unary_answers(
    service_loop: LoopThread, target: Service, draft: Service, prompt: list[int]
) -> None:
    _prefill(target, ["a", "b"], prompt)
    client, draft_client = _clients(service_loop, target.port, draft.port)
    assert draft_client is not None
    try:
        answers = [service_loop.run(client.verify([VerifyItem("a", v, t, ArgmaxMode())], 30.0))
                   for v, t in _chunks(prompt)]
        expected = [target.stub.Verify(_verify_request("b", v, t)).results[0] for v, t in _chunks(prompt)]
        assert ([typing.cast(VerifiedArgmax, a.value["a"]).tokens for a in answers]
                == [list(e.argmax.ids) for e in expected])
        assert all(a.compute_s > 0 and a.wall_s > a.compute_s for a in answers)
        assert isinstance(client._verify, StreamedRpc)  # kept streams, the default
        stream = client._verify._call
        assert stream is not None and not stream.done()  # the same stream carried all three

        proposals = [service_loop.run(draft_client.propose([ProposeItem("d", v, t, 2, GREEDY)], 30.0))
                     for v, t in [(0, prompt), (len(prompt), [9])]]
        assert [len(p.value["d"].tokens) for p in proposals] == [2, 2]
    finally:
        _close(service_loop, client, draft_client)


def test_an_abandoned_exchange_never_answers_the_next_request(
    service_loop: LoopThread, target: Service, prompt: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deadline passes while the target still computes: DEADLINE_EXCEEDED, as a unary call
    would fail, and the next request is answered on a new stream with its own answer."""
    _prefill(target, ["slow", "next"], prompt)
    slow_down(monkeypatch, target.engine, "verify", 0.5)  # still computing at the deadline, on any machine
    client, _ = _clients(service_loop, target.port)
    try:
        slow = [VerifyItem("slow", len(prompt), [5], DecodeMode(9))]
        with pytest.raises(grpc.aio.AioRpcError) as error:
            service_loop.run(client.verify(slow, 0.001))
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        answer = service_loop.run(client.verify([VerifyItem("next", len(prompt), [11, 12], ArgmaxMode())], 30.0))
        assert list(answer.value) == ["next"]
        assert answer.value["next"].cached_len == len(prompt) + 2
    finally:
        _close(service_loop, client)


def test_a_service_error_fails_the_exchange_with_its_status_and_the_next_one_works(
    service_loop: LoopThread, target: Service, prompt: list[int]
) -> None:
    _prefill(target, ["known"], prompt)
    client, _ = _clients(service_loop, target.port)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            service_loop.run(client.verify([VerifyItem("unknown", 0, [5], ArgmaxMode())], 30.0))
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        answer = service_loop.run(client.verify([VerifyItem("known", len(prompt), [5], ArgmaxMode())], 30.0))
        assert answer.value["known"].cached_len == len(prompt) + 1
    finally:
        _close(service_loop, client)


def test_overlapping_exchanges_are_both_answered(service_loop: LoopThread, target: Service, prompt: list[int]) -> None:
    """The second of two concurrent calls goes unary rather than queue on the stream."""
    _prefill(target, ["x", "y"], prompt)
    client, _ = _clients(service_loop, target.port)

    async def both() -> list[int]:
        calls = [client.verify([VerifyItem(slot, len(prompt), [5, 6], ArgmaxMode())], 30.0) for slot in ("x", "y")]
        answers = await asyncio.gather(*calls)
        return [a.value[slot].cached_len for a, slot in zip(answers, ("x", "y"))]

    try:
        assert service_loop.run(both()) == [len(prompt) + 2] * 2
    finally:
        _close(service_loop, client)


def test_a_stopped_service_fails_the_next_exchange_as_unavailable(
    service_loop: LoopThread, fp32_runtime: ModelRuntime, prompt: list[int]
) -> None:
    server = service_loop.run(target_server(fp32_runtime, **SMALL_POOL)[1])
    client, _ = _clients(service_loop, server.port)
    try:
        service_loop.run(client.prefill([PrefillItem("s", prompt)], 30.0))
        service_loop.run(client.verify([VerifyItem("s", len(prompt), [5], ArgmaxMode())], 30.0))
        service_loop.run(server.stop(grace=5.0))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            service_loop.run(client.verify([VerifyItem("s", len(prompt) + 1, [6], ArgmaxMode())], 5.0))
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        _close(service_loop, client)
