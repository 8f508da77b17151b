"""`SamplingParams` through its protobuf form and back."""

from __future__ import annotations

import pytest

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


def test_a_bad_field_from_the_wire_is_named() -> None:
    with pytest.raises(InvalidArgumentError, match="logit_bias"):
        sampling_from_pb(common_pb2.SamplingParams(logit_bias={-4: 1.0}))
    with pytest.raises(InvalidArgumentError, match="penalty_start"):
        sampling_from_pb(common_pb2.SamplingParams(penalty_start=-1))
