"""The OpenAI-compatible HTTP front against a live stack on loopback, with the official `openai`
client (and aiohttp's, for the raw server-sent events and a client that walks away).

One module stack serves every test, over TLS and with a bearer token on both ports, so each
test also exercises the security the front shares with gRPC.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Iterator
from typing import Any, Literal

import aiohttp
import pytest

# A dev extra: where it is missing (the GPU machine runs the suite's collection with its own
# packages), this module is skipped rather than stopping the collection.
pytest.importorskip("openai", reason="the pip package openai is needed (a dev extra)")
import openai  # noqa: E402
import pydantic  # noqa: E402  (an openai dependency)
from openai.types.chat import ChatCompletionMessageParam  # noqa: E402

from specdec.client import SpecdecClient
from specdec.gateway.tools import AutoCalls, Message, Tool, ToolCall, ToolUse, render_messages
from specdec.gateway.tools.hermes import Hermes
from specdec.model.chat import encode_chat
from specdec.model.runtime import ModelRuntime
from tests.support.pki import Pki
from tests.support.services import slow_down
from tests.support.stacks import Stack, StartStack, chat

TOKEN = "0pen-ai"
QUESTION = "Name three colours."
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": QUESTION}]
#: Small, so a too-large body costs little to send.
MAX_REQUEST_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def stack(start_module_stack: StartStack, int8_runtime: ModelRuntime, pki: Pki,
          tmp_path_factory: pytest.TempPathFactory) -> Stack:
    token_file = tmp_path_factory.mktemp("openai") / "token"
    token_file.write_text(TOKEN)
    return start_module_stack(int8_runtime, http_port=0, tls_cert=pki.server_cert, tls_key=pki.server_key,
                              auth_token_file=str(token_file), max_request_bytes=MAX_REQUEST_BYTES)


@pytest.fixture(scope="module")
def base_url(stack: Stack) -> str:
    return f"https://127.0.0.1:{stack.gateway.http_port}"


@pytest.fixture(scope="module")
def client(base_url: str, pki: Pki) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=TOKEN, max_retries=0, timeout=60,
                       http_client=openai.DefaultHttpxClient(verify=_ssl(pki))) as client:
        yield client


def grpc_client(stack: Stack, pki: Pki) -> SpecdecClient:
    return SpecdecClient(stack.address, timeout=60, tls_ca=pki.ca, token=TOKEN)


def test_greedy_chat_equals_grpc_generate(client: openai.OpenAI, stack: Stack, pki: Pki) -> None:
    with grpc_client(stack, pki) as grpc:
        expected = grpc.generate(chat(QUESTION), max_new_tokens=16)
    reply = client.chat.completions.create(model="", messages=MESSAGES, max_tokens=16,
                                           temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 16
    assert reply.usage.prompt_tokens == expected.prompt_tokens
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 16
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    stats = reply.model_extra["speculation"] if reply.model_extra else {}
    assert stats["num_drafts"] > 0 and 0 <= stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    assert stats["acceptance_rate"] == pytest.approx(stats["num_accepted_tokens"] / stats["num_draft_tokens"])


def test_streamed_chat_equals_the_whole_answer(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="", messages=MESSAGES, max_tokens=12,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model="", messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert finals[0].model_extra and finals[0].model_extra["speculation"]["num_drafts"] > 0
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_completions_whole_and_streamed(client: openai.OpenAI, stack: Stack, pki: Pki) -> None:
    prompt = "Once upon a time, in a small village,"
    with grpc_client(stack, pki) as grpc:
        expected = grpc.generate(prompt, max_new_tokens=10)
    assert expected.completion_tokens == 10  # a prompt the model continues, not ends
    whole = client.completions.create(model=stack.target.runtime.loaded.model_id, prompt=[prompt], max_tokens=10,
                                      temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].text == expected.text
    streamed = list(client.completions.create(model="", prompt=prompt, max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    assert streamed[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in streamed)  # no include_usage: no usage chunk


def test_the_speculation_extension_reaches_the_request(client: openai.OpenAI) -> None:
    def stats(**speculation: Any) -> tuple[str | None, dict[str, Any]]:
        reply = client.chat.completions.create(model="", messages=MESSAGES, max_tokens=12,
                                               temperature=0, extra_body={"speculation": speculation})
        return reply.choices[0].message.content, (reply.model_extra or {})["speculation"]

    plain_text, plain = stats(enabled=False)
    assert plain["num_drafts"] == 0 and plain["num_plain_rounds"] > 0
    fixed_text, fixed = stats(num_speculative_tokens=2)
    # At most K = 2 a round (fewer near max_tokens), where the gateway's own K is 8.
    assert fixed["num_drafts"] > 0 and fixed["num_drafts"] <= fixed["num_draft_tokens"] <= 2 * fixed["num_drafts"]
    assert fixed_text == plain_text  # greedy output does not depend on speculation


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.9, "seed": 3}],
                         ids=["greedy", "seeded"])
def test_logprobs_equal_with_and_without_speculation(client: openai.OpenAI, sampling: dict[str, Any]) -> None:
    """The target's own logprobs at each token's position, whatever drafted them: greedy and seeded
    requests emit the same tokens with speculation on and off, and so the same logprobs."""
    def answer(speculation: dict[str, Any]) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(model="", messages=MESSAGES, max_tokens=12, logprobs=True,
                                              top_logprobs=3, extra_body={"speculation": speculation}, **sampling)

    speculative, plain = answer({"num_speculative_tokens": 4}), answer({"enabled": False})
    assert (speculative.model_extra or {})["speculation"]["num_drafts"] > 0
    spec_lp, plain_lp = speculative.choices[0].logprobs, plain.choices[0].logprobs
    assert spec_lp is not None and spec_lp.content is not None and plain_lp is not None and plain_lp.content
    assert speculative.choices[0].message.content == plain.choices[0].message.content
    assert len(spec_lp.content) == len(plain_lp.content) == 12
    for ours, theirs in zip(spec_lp.content, plain_lp.content, strict=True):
        assert ours.token == theirs.token and ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert ours.bytes == list(ours.token.encode()) and len(ours.top_logprobs) == 3
        assert [t.logprob for t in ours.top_logprobs] == sorted((t.logprob for t in ours.top_logprobs), reverse=True)
        assert ours.logprob <= ours.top_logprobs[0].logprob + 1e-6 <= 1e-6


def test_completions_logprobs_and_their_offsets(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="", prompt="The capital of France is", max_tokens=6, temperature=0,
                                      logprobs=2)
    logprobs, text = reply.choices[0].logprobs, reply.choices[0].text
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs and logprobs.top_logprobs
    assert "".join(logprobs.tokens) == text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) == 2 and top[token] == pytest.approx(value)  # greedy: the token is the most likely


def test_sampling_fields_reach_the_request(client: openai.OpenAI, stack: Stack, pki: Pki) -> None:
    """min_p, logit_bias and the presence and frequency penalties, sent the OpenAI way, decode as the
    gRPC API's own fields do; a seeded request then emits the same text with speculation on and off."""
    with grpc_client(stack, pki) as grpc:
        banned = grpc.generate(chat(QUESTION), max_new_tokens=4).token_ids[0]  # the first greedy token
        fields = dict(temperature=0.8, seed=5, min_p=0.05, presence_penalty=0.6, frequency_penalty=0.4)
        expected = grpc.generate(chat(QUESTION), max_new_tokens=16, logit_bias={banned: -100.0}, **fields)
    assert banned not in expected.token_ids

    def answer(speculation: dict[str, Any]) -> str | None:
        reply = client.chat.completions.create(
            model="", messages=MESSAGES, max_tokens=16, temperature=0.8, seed=5, logit_bias={str(banned): -100},
            presence_penalty=0.6, frequency_penalty=0.4, extra_body={"min_p": 0.05, "speculation": speculation})
        return reply.choices[0].message.content

    assert answer({"num_speculative_tokens": 4}) == answer({"enabled": False}) == expected.text


def test_models_and_health(client: openai.OpenAI, stack: Stack, base_url: str, pki: Pki) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [stack.target.runtime.loaded.name]

    async def health() -> tuple[int, Any, str]:  # open without the token, like gRPC health checks
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base_url}/health", ssl=_ssl(pki)) as reply:
                status, body = reply.status, await reply.json()
            async with session.get(f"{base_url}/metrics", ssl=_ssl(pki)) as metrics:  # scrapers need none either
                assert metrics.status == 200 and metrics.content_type == "text/plain"
                return status, body, await metrics.text()

    status, body, metrics = asyncio.run(health())
    assert (status, body) == (200, {"status": "ok"})
    assert "specdec_num_requests_waiting{" in metrics


# Tools (docs/openai.md#tools). SmolLM2 is a ChatML model: the hermes format.
WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK: dict[str, Any] = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 16}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
WEATHER_QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize(("body", "param"), [
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 2}, "n"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"speculation": {"verification": "maybe"}}, "speculation.verification"),
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "strng"}}}}}], "tool_choice": "required"}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": 3}}]}]},
     "messages[0].tool_calls[0].function.name"),
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"max_completion_tokens": 10**6}, "max_completion_tokens"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"speculation": {"num_speculative_tokens": 99}}, "speculation.num_speculative_tokens"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
     "response_format.json_schema.schema"),
])
def test_a_bad_field_is_a_400_naming_it(client: openai.OpenAI, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as error:  # extra_body: sent as is, replacing the fields named
        client.chat.completions.create(model="", messages=MESSAGES, max_tokens=4,
                                       extra_body=body)
    assert error.value.status_code == 400 and error.value.param == param, error.value.message
    assert isinstance(error.value.body, dict) and error.value.body["message"].startswith(param)


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    legs: int
    kind: Literal["cat", "dog", "bird"]


def test_response_format_json_schema_through_the_sdks_parse_helper(client: openai.OpenAI) -> None:
    """The SDK sends a strict JSON schema built from the pydantic model and parses the answer with it."""
    reply = client.chat.completions.parse(model="", messages=[{"role": "user", "content": "Describe a pet."}],
                                          max_tokens=48, temperature=0, response_format=Pet)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Pet), choice.message.content
    streamed = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Describe a pet."}], max_tokens=48, temperature=0,
        stream=True, extra_body={"speculation": {"enabled": False}},
        response_format={"type": "json_schema",  # what the parse helper sends: no other keys
                         "json_schema": {"name": "Pet", "schema": {**Pet.model_json_schema(),
                                                                   "additionalProperties": False}}},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert Pet.model_validate_json(text) == choice.message.parsed


def test_response_format_json_object(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="", messages=[{"role": "user", "content": "Reply with {}."}],
                                           max_tokens=24, temperature=0, response_format={"type": "json_object"})
    content = reply.choices[0].message.content or ""
    assert content.startswith("{")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_a_body_nested_past_the_parser_is_a_400(base_url: str, pki: Pki) -> None:
    async def post() -> int:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as session:
            body = '{"messages": ' + "[" * 5000 + "]" * 5000 + "}"
            async with session.post(f"{base_url}/v1/chat/completions", data=body, ssl=_ssl(pki),
                                    headers={"Content-Type": "application/json"}) as reply:
                return reply.status

    assert asyncio.run(post()) == 400


def test_errors_of_the_whole_request(client: openai.OpenAI, base_url: str, pki: Pki) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=4)
    assert missing.value.param == "model" and missing.value.code == "model_not_found"
    with pytest.raises(openai.APIStatusError) as large:
        client.completions.create(model="", prompt="x" * MAX_REQUEST_BYTES, max_tokens=4)
    assert large.value.status_code == 413
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0,
                       http_client=openai.DefaultHttpxClient(verify=_ssl(pki))) as intruder:
        with pytest.raises(openai.AuthenticationError) as refused:
            intruder.models.list()
    assert refused.value.code == "invalid_api_key"


def _ssl(pki: Pki) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=pki.ca)


async def _post_stream(base_url: str, pki: Pki, body: dict[str, Any]) -> tuple[str, str]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession() as session, session.post(
        f"{base_url}/v1/completions", json=body, headers=headers, ssl=_ssl(pki),
    ) as reply:
        assert reply.status == 200
        return reply.headers["Content-Type"], (await reply.read()).decode()


def test_raw_server_sent_events(base_url: str, pki: Pki) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    content_type, raw = asyncio.run(_post_stream(base_url, pki, body))
    assert content_type.startswith("text/event-stream")
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.removesuffix("\n\n").split("\n\n")
    assert all(event.startswith("data: ") and "\n" not in event for event in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and "speculation" in chunks[-2]
    assert all(c["usage"] is None for c in chunks[:-1])


def test_a_client_that_walks_away_frees_its_slots(
    base_url: str, pki: Pki, stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each round takes 0.2 s more: the request is still running when its client leaves, on any machine.
    slow_down(monkeypatch, stack.target, "verify", 0.2)

    async def read_one_chunk_and_leave() -> str:
        body = {"prompt": "Tell me a long story.", "max_tokens": 2000, "stream": True}
        async with aiohttp.ClientSession() as session, session.post(
            f"{base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, ssl=_ssl(pki),
        ) as reply:
            return (await reply.content.readuntil(b"\n\n")).decode()

    first = asyncio.run(read_one_chunk_and_leave())
    assert first.startswith("data: ")
    stack.wait_until_idle(timeout=20)  # both services freed the request's slots


def test_tls_is_required_when_configured(base_url: str) -> None:
    async def plaintext() -> None:
        async with aiohttp.ClientSession() as session:
            await session.get(base_url.replace("https:", "http:") + "/health")

    with pytest.raises(aiohttp.ClientError):
        asyncio.run(plaintext())


def _valid_call(name: str, arguments: str) -> None:
    """A call of one of TOOLS whose arguments satisfy its schema."""
    schema = SCHEMAS[name]
    value = json.loads(arguments)
    assert isinstance(value, dict) and set(schema["required"]) <= set(value) <= set(schema["properties"]), value
    for key, item in value.items():
        rule = schema["properties"][key]
        assert item in rule["enum"] if "enum" in rule else isinstance(item, str) and len(item) <= rule["maxLength"]


def _streamed_calls(chunks: list[Any]) -> tuple[str, list[tuple[str, str, str]], list[str | None]]:
    """Content, (id, name, arguments) per call, and the finish reasons of a streamed answer."""
    content, calls, reasons = "", [], []
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:  # a call's first delta names it
                assert call.index == len(calls) and call.type == "function" and call.function
                calls.append([call.id, call.function.name or "", ""])
            calls[call.index][2] += call.function.arguments or "" if call.function else ""
        reasons.append(chunk.choices[0].finish_reason)
    return content, [(i, n, a) for i, n, a in calls], [r for r in reasons if r]


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_forced_tool_calls_whole_and_streamed(client: openai.OpenAI, tool_choice: Any) -> None:
    """A named function and `required` are a grammar: always valid calls, streamed as OpenAI does."""
    options: dict[str, Any] = dict(model="", messages=WEATHER_QUESTION, tools=TOOLS, tool_choice=tool_choice,
                                   max_tokens=48, temperature=0, parallel_tool_calls=False)
    reply = client.chat.completions.create(**options)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice.message
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].id.startswith("call_") and calls[0].type == "function"
    _valid_call(calls[0].function.name, calls[0].function.arguments)  # type: ignore[union-attr]
    if isinstance(tool_choice, dict):
        assert calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    content, streamed, reasons = _streamed_calls(list(client.chat.completions.create(**options, stream=True)))
    assert content == "" and reasons == ["tool_calls"]
    assert [(name, arguments) for _, name, arguments in streamed] == [
        (call.function.name, call.function.arguments) for call in calls]  # type: ignore[union-attr]


def test_auto_and_none_answers_are_well_formed(client: openai.OpenAI) -> None:
    """SmolLM2 rarely calls a tool on its own: under `auto` the answer is content or valid calls."""
    options: dict[str, Any] = dict(model="", messages=WEATHER_QUESTION, tools=TOOLS, max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**options)  # tool_choice absent: auto
    choice = whole.choices[0]
    for call in choice.message.tool_calls or []:
        _valid_call(call.function.name, call.function.arguments)  # type: ignore[union-attr]
    assert choice.finish_reason == ("tool_calls" if choice.message.tool_calls else choice.finish_reason)
    assert choice.message.tool_calls or isinstance(choice.message.content, str)
    content, calls, reasons = _streamed_calls(list(client.chat.completions.create(**options, stream=True)))
    assert (content or None, reasons) == (choice.message.content or None, [choice.finish_reason])
    none = client.chat.completions.create(**{**options, "max_tokens": 4}, tool_choice="none")
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


def test_a_tool_history_is_rendered_in_the_models_format(client: openai.OpenAI, stack: Stack) -> None:
    """A call the assistant made and the tool's result reach the prompt as hermes writes them."""
    history: list[ChatCompletionMessageParam] = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    reply = client.chat.completions.create(model="", messages=history, tools=TOOLS, max_tokens=1, temperature=0)
    use = ToolUse(tuple(Tool(t["function"]["name"], t["function"]["description"], t["function"]["parameters"])
                        for t in TOOLS), AutoCalls())
    messages = [Message("user", "What is the weather in Paris?"),
                Message("assistant", tool_calls=(ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}'),)),
                Message("tool", '{"temperature": 21}', tool_call_id="call_1")]
    rendered = render_messages(messages, use, Hermes())
    assert "<tool_response>" in rendered[-1][1] and "<tool_call>" in rendered[-2][1]
    prompt = encode_chat(stack.target.runtime.loaded.tokenizer, [{"role": r, "content": c} for r, c in rendered])
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)
