"""`SamplingParams` through its protobuf form and back."""

from __future__ import annotations

import pytest

from specdec.client import build_request
from specdec.errors import InvalidArgumentError
from specdec.sampling.params import SamplingParams
from specdec.v1 import common_pb2
from specdec.wire.items import sampling_from_pb, sampling_to_pb


def test_every_field_survives_the_wire() -> None:
    # Values a float32 holds exactly: the wire's floats are float32.
    params = SamplingParams(temperature=0.5, top_k=7, top_p=0.75, repetition_penalty=1.25, seed=2**63 + 1,
                            min_p=0.125, logit_bias=((3, -100.0), (17, 0.5)), presence_penalty=-1.5,
                            frequency_penalty=2.0, penalty_start=321)
    assert sampling_from_pb(sampling_to_pb(params)) == params


def test_proto_defaults_leave_every_transform_off() -> None:
    params = sampling_from_pb(common_pb2.SamplingParams())
    assert params == SamplingParams(temperature=0.0)
    assert params.greedy_by_raw_argmax


def test_top_p_and_repetition_penalty_are_off_when_unset_and_checked_when_set() -> None:
    """Unset is 1 (off), as the client leaves them when not given; a 0 sent is out of range."""
    omitted = build_request("hi", temperature=0.5).sampling
    assert not omitted.HasField("top_p") and not omitted.HasField("repetition_penalty")
    assert sampling_from_pb(omitted) == SamplingParams(temperature=0.5)
    assert sampling_from_pb(common_pb2.SamplingParams(temperature=0.5)) == SamplingParams(temperature=0.5)
    with pytest.raises(InvalidArgumentError, match="top_p"):
        sampling_from_pb(common_pb2.SamplingParams(top_p=0.0))
    with pytest.raises(InvalidArgumentError, match="repetition_penalty"):
        sampling_from_pb(common_pb2.SamplingParams(repetition_penalty=0.0))


def test_a_bad_field_from_the_wire_is_named() -> None:
    with pytest.raises(InvalidArgumentError, match="logit_bias"):
        sampling_from_pb(common_pb2.SamplingParams(logit_bias={-4: 1.0}))
    with pytest.raises(InvalidArgumentError, match="penalty_start"):
        sampling_from_pb(common_pb2.SamplingParams(penalty_start=-1))
