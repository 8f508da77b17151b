"""Logprob requests and answers survive protobuf, and items that ask for none carry no byte more."""

from __future__ import annotations

import pytest

from specdec.errors import InvalidArgumentError
from specdec.sampling.logprobs import LogprobsRequest, RowLogprobs
from specdec.sampling.params import SamplingParams
from specdec.sampling.sparse_probs import SparseRows
from specdec.v1 import target_pb2
from specdec.wire.items import (
    ArgmaxMode,
    DecodeMode,
    SampledMode,
    VerifiedArgmax,
    VerifiedDecode,
    VerifiedSampled,
    verified_from_pb,
    verified_to_pb,
    verify_mode_from_pb,
    verify_mode_to_pb,
)

PROCESSED = LogprobsRequest(3, SamplingParams(temperature=0.5, top_k=4))


@pytest.mark.parametrize("mode", [
    ArgmaxMode(LogprobsRequest(5)),
    SampledMode(SamplingParams(temperature=0.5, top_k=4, seed=9), SparseRows.one_hot([3]), PROCESSED),
    DecodeMode(3, None, LogprobsRequest(0)),
    DecodeMode(2, SamplingParams(temperature=0.5), PROCESSED),
], ids=["argmax", "sampled", "decode-greedy", "decode-sampled"])
def test_modes_carry_their_logprobs_request(mode: ArgmaxMode | SampledMode | DecodeMode) -> None:
    wire = target_pb2.VerifyMode.FromString(verify_mode_to_pb(mode).SerializeToString())
    back = verify_mode_from_pb(wire)
    assert back.logprobs == mode.logprobs
    assert type(back) is type(mode)


def test_a_top_above_twenty_is_refused_by_the_target() -> None:
    wire = verify_mode_to_pb(ArgmaxMode(LogprobsRequest(21)))
    with pytest.raises(InvalidArgumentError, match="logprobs.top"):
        verify_mode_from_pb(wire)


def test_answers_round_trip_and_cost_nothing_when_not_asked() -> None:
    rows = RowLogprobs([-0.5], [-0.25, -1.5], [[(4, -0.25), (7, -2.0)], [(1, -1.5), (4, -3.0)]])
    for chunk in (VerifiedArgmax("s", 9, [4, 1], rows), VerifiedSampled("s", 9, [4, 1], [0.5], rows),
                  VerifiedDecode("s", 9, [4, 1], rows)):
        back = verified_from_pb(target_pb2.VerifyResult.FromString(verified_to_pb(chunk).SerializeToString()))
        assert back == chunk
    plain = VerifiedArgmax("s", 9, [4, 1])
    assert not verified_to_pb(plain).HasField("logprobs")
    assert verified_to_pb(plain).ByteSize() == target_pb2.VerifyResult(
        slot_id="s", cached_len=9, argmax=target_pb2.TokenIds(ids=[4, 1])).ByteSize()
    assert not verify_mode_to_pb(ArgmaxMode()).argmax.HasField("logprobs")
