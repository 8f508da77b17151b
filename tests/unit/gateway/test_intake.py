"""Edge rules of `new_request` that the scheduler relies on."""

from __future__ import annotations

import pytest

from specdec.errors import InvalidArgumentError
from specdec.gateway.draft_sources import SpeculationMethod
from specdec.gateway.intake import new_request
from specdec.v1 import common_pb2, gateway_pb2
from tests.support.fakes import VOCAB, policy


def test_max_new_tokens_is_capped_at_what_the_sequence_limit_leaves() -> None:
    huge = new_request(gateway_pb2.GenerateRequest(prompt="hello", max_new_tokens=10**9), policy())
    assert huge.max_new_tokens == 256 - 5  # the toy policy's max_seq_len minus the prompt
    small = new_request(gateway_pb2.GenerateRequest(prompt="hello", max_new_tokens=7), policy())
    assert small.max_new_tokens == 7
    with pytest.raises(InvalidArgumentError, match="^max_new_tokens: 252 is more than the 251 tokens"):
        new_request(gateway_pb2.GenerateRequest(prompt="hello", max_new_tokens=252, refuse_past_context=True),
                     policy())
    exact = gateway_pb2.GenerateRequest(prompt="hello", max_new_tokens=251, refuse_past_context=True)
    assert new_request(exact, policy()).max_new_tokens == 251
    assert new_request(gateway_pb2.GenerateRequest(prompt="hello", refuse_past_context=True), policy()
                        ).max_new_tokens == 16  # unset: the default, capped as ever


def test_slot_ids_carry_the_gateway_instance() -> None:
    seq = new_request(gateway_pb2.GenerateRequest(prompt="hello"), policy(slot_prefix="gw-1/0001/"))
    other = new_request(gateway_pb2.GenerateRequest(prompt="hello"), policy(slot_prefix="gw-1/0001/"))
    assert seq.slot_id.startswith("gw-1/0001/") and seq.slot_id != other.slot_id


def method_of(speculation: gateway_pb2.SpeculationOptions, **policy_options: object) -> SpeculationMethod:
    request = gateway_pb2.GenerateRequest(prompt="hello", speculation=speculation)
    return new_request(request, policy(**policy_options)).method  # type: ignore[arg-type]


def test_the_speculation_method_comes_from_the_request_or_the_gateway() -> None:
    options = gateway_pb2.SpeculationOptions
    assert method_of(options()) is SpeculationMethod.MODEL  # the toy policy's default
    assert method_of(options(method=gateway_pb2.SPECULATION_METHOD_NGRAM)) is SpeculationMethod.NGRAM
    assert method_of(options(enabled=False)) is SpeculationMethod.NONE
    assert method_of(options(method=gateway_pb2.SPECULATION_METHOD_NONE)) is SpeculationMethod.NONE
    # A gateway that does not speculate by default: naming a method opts in.
    assert method_of(options(), speculative=False) is SpeculationMethod.NONE
    assert method_of(options(method=gateway_pb2.SPECULATION_METHOD_AUTO), speculative=False) is SpeculationMethod.AUTO
    # Without a draft model, lookups still speculate.
    assert method_of(options(enabled=True), has_draft=False, method=SpeculationMethod.AUTO) is SpeculationMethod.AUTO
    seq = new_request(gateway_pb2.GenerateRequest(prompt="hello", speculation=options(enabled=False)), policy())
    assert seq.num_speculative_tokens == 0


@pytest.mark.parametrize(("speculation", "policy_options", "message"), [
    ({"method": gateway_pb2.SPECULATION_METHOD_MODEL}, {"has_draft": False}, "without a draft model"),
    ({"enabled": False, "method": gateway_pb2.SPECULATION_METHOD_NGRAM}, {}, "contradicts enabled = false"),
    ({"method": 99}, {}, "unknown value 99"),
])
def test_a_method_the_gateway_cannot_serve_is_an_invalid_argument(
    speculation: dict[str, object], policy_options: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        method_of(gateway_pb2.SpeculationOptions(**speculation), **policy_options)  # type: ignore[arg-type]


def test_the_output_penalties_count_from_the_prompt_end_whatever_the_client_sent() -> None:
    sampling = common_pb2.SamplingParams(presence_penalty=0.5, penalty_start=99, logit_bias={3: 1.0})
    seq = new_request(gateway_pb2.GenerateRequest(prompt="hello", sampling=sampling), policy())
    assert seq.sampling.penalty_start == len(seq.prompt) == 5
    assert seq.draft_sampling.penalty_start == seq.target_sampling.penalty_start == 5
    assert seq.sampling.logit_bias == ((3, 1.0),)


def test_a_logit_bias_outside_the_vocabulary_is_an_invalid_argument() -> None:
    sampling = common_pb2.SamplingParams(logit_bias={3: 1.0, VOCAB: 1.0})
    with pytest.raises(InvalidArgumentError, match=f"sampling.logit_bias: token id {VOCAB} is outside the vocabulary"):
        new_request(gateway_pb2.GenerateRequest(prompt="hello", sampling=sampling), policy())


@pytest.mark.parametrize(("request_", "field"), [
    (gateway_pb2.GenerateRequest(prompt="hello", max_new_tokens=-1), "max_new_tokens"),
    (gateway_pb2.GenerateRequest(), "input"),
    (gateway_pb2.GenerateRequest(prompt="hello", stop=["ok", ""]), "stop[1]"),
    (gateway_pb2.GenerateRequest(chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="robot")])),
     "chat.messages[0].role"),
    (gateway_pb2.GenerateRequest(prompt="hello", sampling=common_pb2.SamplingParams(temperature=-1.0)), "temperature"),
])
def test_a_refusal_carries_the_field_it_is_about(request_: gateway_pb2.GenerateRequest, field: str) -> None:
    """Fronts read the field from the error (the OpenAI front renames it), and the message starts with it."""
    with pytest.raises(InvalidArgumentError) as refused:
        new_request(request_, policy())
    assert refused.value.field == field and str(refused.value).startswith(field)
    assert refused.value.named("renamed").startswith("renamed")
