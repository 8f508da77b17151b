"""How a model family writes tool calls: what its prompt says about the tools, how a call and a
tool's result are rendered into the history, the grammar of a forced call, and the scanner that
reads calls out of the model's text (docs/openai.md#tools).

Two formats: `hermes` (ChatML models: calls between `<tool_call>` tags) and `llama3_json`
(Llama 3.x: the whole answer is a JSON call); `family.choose_format` picks one for a tokenizer.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Collection, Sequence
from typing import Any, ClassVar, Protocol

from specdec.gateway.tools.types import COMPACT, Tool, ToolCall

#: What a scanner hands on: text that is content, or a call it read.
Piece = str | ToolCall
#: The keys that hold a schema's shared definitions: kept at the root of a call's schema, where
#: their `#/$defs/...` references resolve.
DEFINITION_KEYS = ("$defs", "definitions")
#: Compact JSON inside a call, as in every structured output (grammar/spec.py: JSON_DEFAULTS).
COMPACT_JSON = {"whitespace_flexible": False}
#: The keys any format reads as a call's arguments.
ARGUMENTS_KEYS = ("arguments", "parameters")


class Scanner(Protocol):
    """Reads one answer's text as it streams: `feed` returns what it can decide now (content
    and whole calls, in order) and holds back text that may still become a call; `finish`
    returns the rest."""

    def feed(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...


class ToolFormat(abc.ABC):
    """One model family's convention for tools. `arguments_key`: the key of a call's arguments
    object in the JSON the model writes."""

    name: ClassVar[str]
    arguments_key: ClassVar[str]
    #: The role a tool's result is rendered with.
    result_role: ClassVar[str]

    @abc.abstractmethod
    def system_text(self, tools: Sequence[Tool]) -> str:
        """What the system prompt says about `tools`: each described, and how to call one."""

    @abc.abstractmethod
    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        """An assistant message's calls, as the model would have written them."""

    @abc.abstractmethod
    def render_result(self, content: str) -> str:
        """A tool's result, as the content of a `result_role` message."""

    @abc.abstractmethod
    def calls_grammar(self, call_rules: Sequence[str], max_calls: int) -> str:
        """The Lark rules of an answer of 1 to `max_calls` calls, each one of the rules named in
        `call_rules` (one JSON call of one tool each, `call_grammar`)."""

    @abc.abstractmethod
    def scanner(self, names: Collection[str]) -> Scanner:
        """A scanner of one answer; a call to a tool not in `names` stays content."""

    def call_json(self, call: ToolCall) -> str:
        return json.dumps({"name": call.name, self.arguments_key: call.arguments_object()}, ensure_ascii=False)

    def call_schema(self, tool: Tool) -> dict[str, Any]:
        """The JSON Schema of a call of `tool` in this format: its name, then its arguments."""
        arguments = tool.arguments_schema()
        hoisted = {key: arguments.pop(key) for key in DEFINITION_KEYS if key in arguments}
        return {"type": "object", "properties": {"name": {"const": tool.name}, self.arguments_key: arguments},
                "required": ["name", self.arguments_key], "additionalProperties": False,
                "x-guidance": COMPACT_JSON, **hoisted}

    def grammar(self, tools: Sequence[Tool], max_calls: int) -> str:
        """The Lark grammar (llguidance's dialect) of `required`: 1 to `max_calls` calls of `tools`."""
        rules = [f"tool_{i}: %json {json.dumps(self.call_schema(tool))}" for i, tool in enumerate(tools)]
        return "\n".join([self.calls_grammar([f"tool_{i}" for i in range(len(tools))], max_calls), *rules]) + "\n"

    def call_from(self, value: object, names: Collection[str]) -> ToolCall | None:
        """A call from parsed JSON: `{"name": <a tool's>, <arguments_key>: {...}}` (the other
        format's key, or arguments sent as JSON text, are read too); None for anything else."""
        if not isinstance(value, dict) or not isinstance(name := value.get("name"), str) or name not in names:
            return None
        arguments = next((value[key] for key in (self.arguments_key, *ARGUMENTS_KEYS) if key in value), None)
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False, separators=COMPACT))
