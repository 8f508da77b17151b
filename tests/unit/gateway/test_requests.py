"""Edge rules of `new_sequence` that the scheduler relies on."""

from __future__ import annotations

from specdec.gateway.requests import new_sequence
from specdec.v1 import gateway_pb2
from tests.support.fakes import policy


def test_max_new_tokens_is_capped_at_what_the_sequence_limit_leaves() -> None:
    huge = new_sequence(gateway_pb2.GenerateRequest(prompt="hello", max_new_tokens=10**9), policy())
    assert huge.max_new_tokens == 256 - 5  # the toy policy's max_seq_len minus the prompt
    small = new_sequence(gateway_pb2.GenerateRequest(prompt="hello", max_new_tokens=7), policy())
    assert small.max_new_tokens == 7


def test_slot_ids_carry_the_gateway_instance() -> None:
    seq = new_sequence(gateway_pb2.GenerateRequest(prompt="hello"), policy(slot_prefix="gw-1/0001/"))
    other = new_sequence(gateway_pb2.GenerateRequest(prompt="hello"), policy(slot_prefix="gw-1/0001/"))
    assert seq.slot_id.startswith("gw-1/0001/") and seq.slot_id != other.slot_id
