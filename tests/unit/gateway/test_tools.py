"""Tool formats without a server: reading calls out of answers (whole and streamed), rendering a
tool history, the grammars of forced calls, and choosing the format for a model."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from transformers import PreTrainedTokenizerBase

from specdec.gateway.config import TOOL_CALL_PARSERS
from specdec.gateway.grammar import JsonSchema, Lark
from specdec.gateway.tools import (
    PARSER_CHOICES,
    Answer,
    AutoCalls,
    CallDelta,
    Message,
    NamedCall,
    NoCalls,
    RequiredCalls,
    Tool,
    ToolCall,
    ToolFormat,
    ToolUse,
    choose_format,
    read_whole,
    reader_for,
    render_messages,
    structured_output,
)
from specdec.gateway.tools.hermes import Hermes
from specdec.gateway.tools.llama3_json import Llama3Json
from specdec.grammar import GrammarCompiler
from specdec.model.choices import DEFAULT_MODEL
from specdec.model.loader import load_tokenizer
from specdec.model.random_models import LLAMA3_CHAT_TEMPLATE

WEATHER = Tool("get_weather", "The weather in a city.", {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
CLOCK = Tool("get_time")
AUTO = ToolUse((WEATHER, CLOCK), AutoCalls())


def calls_of(text: str, form: ToolFormat, use: ToolUse = AUTO) -> tuple[str | None, list[tuple[str, object]]]:
    reader = reader_for(use, form)
    assert reader is not None
    answer = read_whole(text, reader)
    return answer.content, [(call.name, json.loads(call.arguments)) for call in answer.tool_calls]


def streamed(text: str, form: ToolFormat, use: ToolUse = AUTO) -> Answer:
    """`text` fed a character at a time (the hardest split for the scanners)."""
    reader = reader_for(use, form)
    assert reader is not None
    answer = Answer()
    for char in text:
        answer.add(reader.feed(char))
    answer.add(reader.finish())
    return answer


HERMES_CASES = [
    ("It is sunny.", "It is sunny.", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "Let me look.\n",
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ('<tool_call>{"name": "launch", "arguments": {}}</tool_call>', '<tool_call>{"name": "launch", "arguments": {}}'
     "</tool_call>", []),  # not one of the tools
    ('<tool_call>{"name": "get_time", "arguments": "{}"}', None, [("get_time", {})]),  # left open; arguments as text
    ("a < b <tool", "a < b <tool", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_calls_are_read_whole_and_streamed(text: str, content: str | None, calls: list[object]) -> None:
    assert calls_of(text, Hermes()) == (content, calls)
    answer = streamed(text, Hermes())
    assert (answer.content, [(c.name, json.loads(c.arguments)) for c in answer.tool_calls]) == (content, calls)


LLAMA_CASES = [
    ("It is sunny.", "It is sunny.", []),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}',
     None, [("get_weather", {"city": "Rome"}), ("get_time", {})]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"', '{"name": "get_weather", "parameters": {"city": "Paris"',
     []),  # malformed: content
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "get_time", "parameters": {}} and more', '{"name": "get_time", "parameters": {}} and more', []),
]


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA_CASES)
def test_llama3_json_calls_are_read_whole_and_streamed(text: str, content: str | None, calls: list[object]) -> None:
    assert calls_of(text, Llama3Json()) == (content, calls)
    answer = streamed(text, Llama3Json())
    assert (answer.content, [(c.name, json.loads(c.arguments)) for c in answer.tool_calls]) == (content, calls)


def test_content_streams_before_a_call_and_the_call_comes_whole() -> None:
    reader = reader_for(AUTO, Hermes())
    assert reader is not None
    assert reader.feed("Sure. <tool") == ["Sure. "]  # the tag's start is held
    assert reader.feed('_call>{"name": "get_time", ') == []
    [delta] = reader.feed('"arguments": {}}</tool_call>\n')
    assert isinstance(delta, CallDelta) and delta.index == 0 and delta.call and delta.call.name == "get_time"
    assert delta.call.id.startswith("call_") and reader.finish() == [] and reader.calls == 1
    llama = reader_for(AUTO, Llama3Json())
    assert llama is not None and llama.feed("  ") == [] and llama.feed("Hi") == ["  Hi"] and llama.feed("{") == ["{"]


def test_without_parallel_calls_only_the_first_is_kept() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", ' \
           '"arguments": {"city": "Lima"}}</tool_call>'
    assert calls_of(text, Hermes(), ToolUse(AUTO.tools, AutoCalls(), parallel=False)) == (None, [("get_time", {})])


def test_a_named_call_streams_its_arguments() -> None:
    reader = reader_for(ToolUse(AUTO.tools, NamedCall("get_weather")), Hermes())
    assert reader is not None
    first, second = reader.feed('{"city":'), reader.feed('"Paris"}')
    assert isinstance(first[0], CallDelta) and first[0].call is not None and first[0].call.name == "get_weather"
    assert second == [CallDelta(0, '"Paris"}')] and reader.finish() == []
    assert reader_for(ToolUse(AUTO.tools, NoCalls()), Hermes()) is None


def test_a_tool_history_is_rendered_in_each_format() -> None:
    call = ToolCall("get_weather", '{"city": "Paris"}', "call_1")
    history = [Message("system", "Be brief."), Message("user", "Weather?"), Message("assistant", "", (call,)),
               Message("tool", '{"temp": 21}', tool_call_id="call_1")]
    hermes = render_messages(history, AUTO, Hermes())
    assert hermes[0][0] == "system" and hermes[0][1].startswith("Be brief.\n\n") and '"get_time"' in hermes[0][1]
    assert hermes[2] == ("assistant", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                      "</tool_call>")
    assert hermes[3] == ("tool", '<tool_response>\n{"temp": 21}\n</tool_response>')
    llama = render_messages(history[1:], AUTO, Llama3Json())
    assert llama[0][0] == "system" and '"parameters"' in llama[0][1] and len(llama) == 4  # a system message added
    assert llama[2:] == [("assistant", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
                         ("ipython", '{"temp": 21}')]
    assert render_messages(history[1:], ToolUse(AUTO.tools, NoCalls()), Hermes())[0] == ("user", "Weather?")


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer(DEFAULT_MODEL)


@pytest.mark.parametrize(("form", "answer", "refused"), [
    (Hermes(), '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>\n'
               '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>',
     '<tool_call>\n{"name":"get_weather","arguments":{}}'),
    (Llama3Json(), '{"name":"get_weather","parameters":{"city":"Oslo"}}; {"name":"get_time","parameters":{}}',
     '{"name":"get_time","parameters":{"x"'),
])
def test_required_grammars_take_calls_of_the_tools_only(tokenizer: PreTrainedTokenizerBase, form: ToolFormat,
                                                        answer: str, refused: str) -> None:
    output = structured_output(ToolUse(AUTO.tools, RequiredCalls()), form)
    assert output is not None and output.WhichOneof("kind") == "grammar"
    compiler = GrammarCompiler(tokenizer, 49152, [2])
    for text, allowed in ((answer, True), (refused, False)):
        matcher = compiler.compile(Lark(output.grammar).grammar(), "tools").matcher
        consumed = all(matcher.consume_token(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"])
        assert (consumed and matcher.is_accepting()) == allowed
    reader = reader_for(ToolUse(AUTO.tools, RequiredCalls()), form)
    assert reader is not None and [c.name for c in read_whole(answer, reader).tool_calls] == ["get_weather", "get_time"]
    named = structured_output(ToolUse(AUTO.tools, NamedCall("get_weather")), form)
    assert named is not None and json.loads(named.json_schema) == {"type": "object", **WEATHER.parameters}
    compiler.compile(JsonSchema(named.json_schema).grammar(), "tools[0].function.parameters")


def test_the_format_follows_the_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    assert choose_format(tokenizer).name == "hermes"  # SmolLM2: ChatML
    llama = SimpleNamespace(chat_template=LLAMA3_CHAT_TEMPLATE)
    assert choose_format(llama).name == "llama3_json"  # type: ignore[arg-type]
    assert choose_format(tokenizer, "llama3_json").name == "llama3_json"
    assert TOOL_CALL_PARSERS == PARSER_CHOICES  # the flag's choices, kept apart from the tools package
    assert Tool("f").arguments_schema() == {"type": "object", "properties": {}, "additionalProperties": False}
