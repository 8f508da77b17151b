"""Tools, tool calls and the tool choice of a request, as the formats and readers take them.

Nothing here knows HTTP: the OpenAI front builds these from a request body (docs/openai.md#tools),
and a gRPC client may build them to render a prompt or read an answer the same way.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: Compact JSON, as the grammars emit it.
COMPACT = (",", ":")


def new_call_id() -> str:
    """An id for a call the model made (OpenAI's shape: `call_` and 24 characters)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Tool:
    """A function the model may call. `parameters` is a JSON Schema of its arguments object."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=dict)

    def arguments_schema(self) -> dict[str, Any]:
        """The schema an arguments object must match: `parameters`, an object in any case (no
        parameters: an empty object), compact JSON for the grammar."""
        schema: dict[str, Any] = {"type": "object", **self.parameters}
        if not self.parameters:
            schema.update(properties={}, additionalProperties=False)
        return schema

    def description_json(self) -> str:
        """The tool as the prompt describes it: OpenAI's own `{"type": "function", ...}` form."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.arguments_schema()
        return json.dumps({"type": "function", "function": function}, ensure_ascii=False)


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def arguments_object(self) -> Any:
        """The arguments parsed (what a history renders); text that is no JSON stays text."""
        try:
            return json.loads(self.arguments)
        except ValueError:
            return self.arguments


@dataclass(frozen=True)
class Message:
    """A chat message that may carry tool calls (assistant) or a tool's result (`tool_call_id`)."""

    role: str
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""


# The tool choice: one type per mode (the request's `tool_choice`).


@dataclass(frozen=True)
class NoCalls:
    """`none`: the answer is text; the tools are left out of the prompt."""


@dataclass(frozen=True)
class AutoCalls:
    """`auto`: the model answers freely, in text or with calls in its format, which are parsed out."""


@dataclass(frozen=True)
class RequiredCalls:
    """`required`: a grammar makes the answer one or more calls of the tools, in the model's format."""


@dataclass(frozen=True)
class NamedCall:
    """A named function: a grammar makes the whole answer that function's arguments object."""

    name: str


ToolChoice = NoCalls | AutoCalls | RequiredCalls | NamedCall


@dataclass(frozen=True)
class ToolUse:
    """A request's tools and how it may use them. `parallel`: more than one call an answer."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    parallel: bool = True

    def tool(self, name: str) -> Tool | None:
        return next((tool for tool in self.tools if tool.name == name), None)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(tool.name for tool in self.tools)
