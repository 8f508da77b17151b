"""The OpenAI front's translation of request bodies and responses, without a server."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from specdec.errors import CapacityExhaustedError, InvalidArgumentError
from specdec.gateway.openai.errors import OpenAIError, from_status
from specdec.gateway.openai.protocol import Endpoint, ServedModel, in_body_terms, parse_request
from specdec.gateway.openai.responses import Reply
from specdec.sampling.params import SamplingParams
from specdec.v1 import gateway_pb2

MODEL = ServedModel("smollm2-135m", frozenset({"smollm2-135m", "/models/smollm2.gguf"}), 2048)
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def chat_request(**fields: Any) -> gateway_pb2.GenerateRequest:
    return parse_request({**CHAT, **fields}, Endpoint.CHAT, MODEL).generate


def refusal(body: dict[str, Any], endpoint: Endpoint = Endpoint.CHAT) -> OpenAIError:
    with pytest.raises(OpenAIError) as error:
        parse_request(body, endpoint, MODEL)
    return error.value


def test_a_chat_body_becomes_a_generate_request() -> None:
    request = chat_request(
        model="/models/smollm2.gguf", max_completion_tokens=7, max_tokens=99, temperature=0.5, top_p=0.9, top_k=-1,
        repetition_penalty=1.1, seed=3, stop="END", user="u1", n=1, unknown_field={"x": 1},
        messages=[{"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "it"}]},
                  {"role": "user", "content": "hi"}],
        speculation={"enabled": True, "num_speculative_tokens": 3, "adaptive": False, "method": "ngram"},
    )
    assert request.max_new_tokens == 7  # max_completion_tokens wins, as in OpenAI's API
    assert [(m.role, m.content) for m in request.chat.messages] == [("system", "be it"), ("user", "hi")]
    sampling = request.sampling
    assert (sampling.top_k, sampling.seed, list(request.stop)) == (0, 3, ["END"])
    assert sampling.temperature == pytest.approx(0.5) and sampling.top_p == pytest.approx(0.9)
    spec = request.speculation
    assert (spec.enabled, spec.num_speculative_tokens, spec.adaptive) == (True, 3, False)
    assert spec.method == gateway_pb2.SPECULATION_METHOD_NGRAM


def test_defaults_follow_openai() -> None:
    parsed = parse_request(CHAT, Endpoint.CHAT, MODEL)
    assert parsed.generate.sampling.temperature == 1.0  # OpenAI's default, where gRPC's unset is greedy
    assert parsed.generate.max_new_tokens == 0  # the gateway's --max-new-tokens
    assert not parsed.generate.speculation.HasField("enabled")
    assert (parsed.stream, parsed.include_usage) == (False, False)


def test_a_completion_prompt_may_be_a_list_of_one_string() -> None:
    parsed = parse_request({"prompt": ["Once"], "stream": True, "stream_options": {"include_usage": True}},
                           Endpoint.COMPLETIONS, MODEL)
    assert parsed.generate.prompt == "Once" and parsed.stream and parsed.include_usage


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "echo": True}, "echo"),
    ({"prompt": "a", "seed": -1}, "seed"),
])
def test_bad_completion_fields_name_themselves(body: dict[str, Any], param: str) -> None:
    error = refusal(body, Endpoint.COMPLETIONS)
    assert (error.status, error.param) == (400, param)
    assert error.message.startswith(param)


def test_sampling_and_logprobs_fields_map_to_the_request() -> None:
    request = chat_request(min_p=0.1, logit_bias={"42": 5, "7": -100}, presence_penalty=0.5, frequency_penalty=-0.5,
                           logprobs=True, top_logprobs=4, logprobs_mode="processed_logprobs",
                           speculation={"verification": "drawn"})
    sampling = request.sampling
    assert sampling.min_p == pytest.approx(0.1) and dict(sampling.logit_bias) == {42: 5.0, 7: -100.0}
    assert sampling.presence_penalty == pytest.approx(0.5) and sampling.frequency_penalty == pytest.approx(-0.5)
    assert (request.logprobs.top_logprobs, request.logprobs.processed) == (4, True)
    assert request.speculation.verification == gateway_pb2.VERIFICATION_DRAWN
    assert not chat_request(logprobs=False, top_logprobs=0).HasField("logprobs")
    assert not chat_request().HasField("logprobs")
    completion = parse_request({"prompt": "a", "logprobs": 0}, Endpoint.COMPLETIONS, MODEL).generate
    assert completion.HasField("logprobs") and completion.logprobs.top_logprobs == 0  # the chosen tokens' only


@pytest.mark.parametrize(("body", "param"), [
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"logit_bias": {"3": "big"}}, "logit_bias.3"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"top_logprobs": 1}, "top_logprobs"),
    ({"logprobs": True, "logprobs_mode": "final"}, "logprobs_mode"),
    ({"min_p": "a lot"}, "min_p"),
])
def test_bad_sampling_and_logprobs_fields_name_themselves(body: dict[str, Any], param: str) -> None:
    error = refusal({**CHAT, **body})
    assert (error.status, error.param) == (400, param), error.message


def test_chat_refusals() -> None:
    assert refusal({**CHAT, "model": "gpt-4o"}).status == 404
    assert refusal({**CHAT, "n": 3}).param == "n"
    assert refusal({**CHAT, "functions": [{"name": "f"}]}).param == "functions"  # the deprecated form
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert refusal({"prompt": "hi", "tools": tools}, Endpoint.COMPLETIONS).param == "tools"
    assert refusal({**CHAT, "response_format": {"type": "yaml"}}).param == "response_format.type"
    assert refusal({**CHAT, "response_format": "json"}).param == "response_format"
    assert refusal({**CHAT, "speculation": {"k": 2}}).param == "speculation.k"
    assert refusal({**CHAT, "speculation": {"method": "medusa"}}).param == "speculation.method"
    assert refusal({**CHAT, "temperature": True}).param == "temperature"
    assert refusal({"messages": []}).param == "messages"
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    assert refusal({"messages": [{"role": "user", "content": image}]}).param == "messages[0].content"
    assert refusal(["not", "an", "object"]).status == 400
    assert not chat_request(response_format={"type": "text"}, tools=[], model="").HasField("structured_output")


def test_response_formats_become_structured_output() -> None:
    assert chat_request(response_format={"type": "json_object"}).structured_output.HasField("json_object")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = chat_request(response_format={"type": "json_schema",
                                            "json_schema": {"name": "A", "schema": schema, "strict": True}})
    assert json.loads(request.structured_output.json_schema) == schema
    invalid = InvalidArgumentError("structured_output.json_schema: Invalid type", field="structured_output.json_schema")
    assert in_body_terms(invalid, Endpoint.CHAT)[0] == "response_format.json_schema.schema"


def test_grpc_side_errors_in_openai_terms() -> None:
    role = InvalidArgumentError("chat.messages[2].role: 'x' is not one of system", field="chat.messages[2].role")
    assert in_body_terms(role, Endpoint.CHAT) == ("messages[2].role", "messages[2].role: 'x' is not one of system")
    prompt = InvalidArgumentError("prompt: 9000 tokens leave no room", field="prompt")
    assert in_body_terms(prompt, Endpoint.CHAT)[0] == "messages"
    assert in_body_terms(prompt, Endpoint.COMPLETIONS)[0] == "prompt"
    with pytest.raises(InvalidArgumentError) as refused:
        SamplingParams(temperature=-1.0)
    assert in_body_terms(refused.value, Endpoint.CHAT)[0] == "temperature"
    # The field comes from the error, never from its text: a message that looks like a field names none.
    assert in_body_terms(CapacityExhaustedError("queue: full (64 waiting)", resource="queue"), Endpoint.CHAT) == (
        None, "queue: full (64 waiting)")
    assert in_body_terms(InvalidArgumentError("stop: too many"), Endpoint.CHAT) == (None, "stop: too many")


@pytest.mark.parametrize(("status", "http_status"), [
    (grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (grpc.StatusCode.UNAVAILABLE, 503), (grpc.StatusCode.INTERNAL, 500),
])
def test_grpc_statuses_map_to_http(status: grpc.StatusCode, http_status: int) -> None:
    error = from_status(status, "why")
    assert error.status == http_status
    assert error.body() == {"error": {"message": "why", "type": error.type.value, "param": None, "code": error.code}}


def test_a_stream_ends_with_the_finish_reason_then_the_usage() -> None:
    reply = Reply(parse_request({**CHAT, "stream": True, "stream_options": {"include_usage": True}},
                                Endpoint.CHAT, MODEL), MODEL.name, token_text)
    first = reply.chunks(gateway_pb2.GenerateResponse(token_ids=[1], text="Hel"))
    final = gateway_pb2.Completion(finish_reason=gateway_pb2.FINISH_REASON_STOP,
                                   usage=gateway_pb2.Usage(prompt_tokens=5, completion_tokens=2),
                                   speculation=gateway_pb2.SpeculationStats(num_rounds=1, num_draft_tokens=4,
                                                                            num_accepted_tokens=3))
    rest = reply.chunks(gateway_pb2.GenerateResponse(token_ids=[2], text="lo", completion=final))
    assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    assert [c["choices"][0]["delta"] for c in rest[:2]] == [{"content": "lo"}, {}]
    assert rest[1]["choices"][0]["finish_reason"] == "stop" and rest[1]["speculation"]["num_drafts"] == 1
    assert rest[2]["choices"] == [] and rest[2]["usage"] == {"prompt_tokens": 5, "completion_tokens": 2,
                                                             "total_tokens": 7}
    assert {c["id"] for c in first + rest} == {reply.id}


def token_text(token_id: int) -> str:
    return f"<{token_id}>"


def test_logprobs_take_each_endpoints_form() -> None:
    top = [gateway_pb2.TopLogprob(token_id=2, logprob=-0.1), gateway_pb2.TopLogprob(token_id=9, logprob=float("-inf"))]
    message = gateway_pb2.GenerateResponse(token_ids=[2, 5], text="<2><5>", logprobs=[
        gateway_pb2.TokenLogprob(token_id=2, logprob=-0.1, top=top),
        gateway_pb2.TokenLogprob(token_id=5, logprob=float("-inf"), top=top)])
    final = gateway_pb2.GenerateResponse(
        completion=gateway_pb2.Completion(finish_reason=gateway_pb2.FINISH_REASON_STOP))
    chat = Reply(parse_request({**CHAT, "logprobs": True, "top_logprobs": 2}, Endpoint.CHAT, MODEL), "m", token_text)
    for response in (message, final):
        chat.add(response)
    content = chat.body()["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["logprob"], c["bytes"]) for c in content] == [("<2>", pytest.approx(-0.1), list(b"<2>")),
                                                                         ("<5>", -9999.0, list(b"<5>"))]
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["<2>", "<9>"]
    completion = Reply(parse_request({"prompt": "a", "logprobs": 2, "stream": True}, Endpoint.COMPLETIONS, MODEL),
                       "m", token_text)
    streamed = completion.chunks(message)[0]["choices"][0]["logprobs"]
    assert streamed["tokens"] == ["<2>", "<5>"] and streamed["text_offset"] == [0, 3]
    assert streamed["top_logprobs"][1] == {"<2>": pytest.approx(-0.1), "<9>": -9999.0}
    without = Reply(parse_request(CHAT, Endpoint.CHAT, MODEL), "m", token_text)
    without.add(message)
    without.add(final)
    assert without.body()["choices"][0]["logprobs"] is None


TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {}
    for _ in range(depth):
        schema = {"not": schema}
    return schema


def test_tool_choices_become_prompts_and_grammars() -> None:
    auto = parse_request({**CHAT, "tools": [TOOL]}, Endpoint.CHAT, MODEL)
    system = auto.generate.chat.messages[0]
    assert system.role == "system" and '"get_time"' in system.content and "<tool_call>" in system.content
    assert not auto.generate.HasField("structured_output") and auto.tool_reader is not None
    named = parse_request({**CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {
        "name": "get_time"}}}, Endpoint.CHAT, MODEL)
    assert json.loads(named.generate.structured_output.json_schema)["required"] == ["zone"]
    bad = InvalidArgumentError("structured_output.json_schema: bad", field="structured_output.json_schema")
    assert in_body_terms(bad, Endpoint.CHAT, named.renames)[0] == "tools[0].function.parameters"
    required = chat_request(tools=[TOOL], tool_choice="required")
    assert required.structured_output.grammar.startswith('start: call ("\\n" call){0,7}')
    assert "{0," not in chat_request(tools=[TOOL], tool_choice="required", parallel_tool_calls=False
                                     ).structured_output.grammar
    none = parse_request({**CHAT, "tools": [TOOL], "tool_choice": "none",
                          "response_format": {"type": "json_object"}}, Endpoint.CHAT, MODEL)
    assert none.tool_reader is None and [m.role for m in none.generate.chat.messages] == ["user"]


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": {"name": "f"}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [TOOL, TOOL]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]}, "tools[0].function.description"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": nested(70)}}]},
     "tools[0].function.parameters"),
    ({"tools": [TOOL], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice.function.name"),
    ({"tools": [TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "tool", "content": "1", "tool_call_id": 7}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": {}}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 1}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"tools": [TOOL], "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
])
def test_bad_tool_fields_name_themselves(body: dict[str, Any], param: str) -> None:
    error = refusal({**CHAT, **body})
    assert (error.status, error.param) == (400, param), error.message


def test_max_tokens_past_the_context_is_refused_by_the_gateway_naming_the_field_given() -> None:
    parsed = parse_request({**CHAT, "max_completion_tokens": 10**6}, Endpoint.CHAT, MODEL)
    assert parsed.generate.refuse_past_context and parsed.generate.max_new_tokens == 10**6
    message = "max_new_tokens: 1000000 is more than the 2040 tokens the context of 2048 leaves after the prompt's 8"
    refused = InvalidArgumentError(message, field="max_new_tokens")
    assert in_body_terms(refused, Endpoint.CHAT, parsed.renames)[1].startswith("max_completion_tokens: 1000000")
    assert parse_request({"prompt": "a", "max_tokens": 5}, Endpoint.COMPLETIONS, MODEL).renames == {
        "max_new_tokens": "max_tokens"}


def test_tool_calls_stream_as_openai_deltas_and_end_with_tool_calls() -> None:
    request = parse_request({**CHAT, "tools": [TOOL], "stream": True}, Endpoint.CHAT, MODEL)
    reply, whole = Reply(request, "m", token_text), Reply(request, "m", token_text)
    texts = ["Hi. <tool_", 'call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>', ""]
    final = gateway_pb2.Completion(finish_reason=gateway_pb2.FINISH_REASON_STOP)
    chunks = []
    for i, text in enumerate(texts):
        response = gateway_pb2.GenerateResponse(token_ids=[i], text=text,
                                                completion=final if i == len(texts) - 1 else None)
        chunks += reply.chunks(response)
        whole.add(response)
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    call = deltas[1]["tool_calls"][0]
    assert deltas[0] == {"role": "assistant", "content": "Hi. "} and deltas[2:] == [{}, {}]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_time", "arguments": '{"zone":"UTC"}'}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    message = whole.body()["choices"][0]["message"]
    assert message["content"] == "Hi. " and message["tool_calls"][0]["function"] == call["function"]
    assert whole.body()["choices"][0]["finish_reason"] == "tool_calls"
