"""A chat body's `tools`, `tool_choice` and `parallel_tool_calls` as a `ToolUse`, checked, each
error naming its field as OpenAI does (`tools[0].function.name`, `tool_choice.function.name`)."""

from __future__ import annotations

import re
from typing import Any

from specdec.gateway.grammar.spec import MAX_SCHEMA_DEPTH
from specdec.gateway.openai.errors import invalid_field
from specdec.gateway.openai.fields import boolean, json_type
from specdec.gateway.tools import AutoCalls, NamedCall, NoCalls, RequiredCalls, Tool, ToolChoice, ToolUse

#: OpenAI's rule for a function's name.
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: OpenAI's limit on the tools of a request.
MAX_TOOLS = 128
CHOICE_MODES: dict[str, ToolChoice] = {"none": NoCalls(), "auto": AutoCalls(), "required": RequiredCalls()}


def tool_use_from_body(body: dict[str, Any]) -> ToolUse | None:
    """None when the request has no tools (`tools` absent or empty, `tool_choice` none or absent)."""
    tools = tools_from_body(body.get("tools"))
    choice = tool_choice_from_body(body.get("tool_choice"), tools)
    parallel = boolean(body, "parallel_tool_calls")
    if not tools:
        return None
    return ToolUse(tools, choice, True if parallel is None else parallel)


def tools_from_body(value: object) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise invalid_field("tools", f"must be a list of tools, got {json_type(value)}")
    if len(value) > MAX_TOOLS:
        raise invalid_field("tools", f"at most {MAX_TOOLS} tools, got {len(value)}")
    tools = tuple(tool_from_body(tool, f"tools[{i}]") for i, tool in enumerate(value))
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise invalid_field(f"tools[{i}].function.name", f"another tool is named {tool.name!r}")
        seen.add(tool.name)
    return tools


def tool_from_body(value: object, param: str) -> Tool:
    """`{"type": "function", "function": {"name", "description", "parameters", "strict"}}`."""
    if not isinstance(value, dict):
        raise invalid_field(param, f"must be an object, got {json_type(value)}")
    if value.get("type") != "function":
        raise invalid_field(f"{param}.type", f"must be \"function\", got {value.get('type')!r}")
    function = value.get("function")
    if not isinstance(function, dict):
        raise invalid_field(f"{param}.function", "must be an object with a name")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise invalid_field(f"{param}.function.name", "must be 1 to 64 letters, digits, underscores or dashes")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid_field(f"{param}.function.description", f"must be a string, got {json_type(description)}")
    boolean(function, "strict", f"{param}.function.")  # enforced either way, as response_format's
    return Tool(name, description or "", parameters_from_body(function.get("parameters"), f"{param}.function"))


def parameters_from_body(parameters: object, param: str) -> dict[str, Any]:
    """A JSON Schema of an object (`type` object or absent), nested at most MAX_SCHEMA_DEPTH deep;
    absent: no parameters."""
    if parameters is None:
        return {}
    where = f"{param}.parameters"
    if not isinstance(parameters, dict):
        raise invalid_field(where, f"must be a JSON Schema object, got {json_type(parameters)}")
    if parameters.get("type", "object") != "object":
        raise invalid_field(where, f"must be the schema of an object (type object), got type "
                                   f"{parameters.get('type')!r}")
    if _depth(parameters) > MAX_SCHEMA_DEPTH:
        raise invalid_field(where, f"nested deeper than {MAX_SCHEMA_DEPTH} levels")
    return parameters


def tool_choice_from_body(value: object, tools: tuple[Tool, ...]) -> ToolChoice:
    """`none`, `auto` (the default with tools), `required`, or `{"type": "function", "function":
    {"name"}}` naming one of `tools`; any but `none` needs tools."""
    if value is None:
        return AutoCalls() if tools else NoCalls()
    if isinstance(value, str) and value in CHOICE_MODES:
        choice = CHOICE_MODES[value]
    elif isinstance(value, dict):
        if value.get("type") != "function":
            raise invalid_field("tool_choice.type", f"must be \"function\", got {value.get('type')!r}")
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise invalid_field("tool_choice.function.name", "must be a string")
        if name not in {tool.name for tool in tools}:
            raise invalid_field("tool_choice.function.name", f"{name!r} is not the name of one of the tools")
        choice = NamedCall(name)
    else:
        raise invalid_field("tool_choice", 'must be "none", "auto", "required" or '
                                           '{"type": "function", "function": {"name": ...}}')
    if not tools and not isinstance(choice, NoCalls):
        raise invalid_field("tool_choice", "needs tools: the request has none")
    return choice


def _depth(value: object) -> int:
    """How deep objects and lists nest in parsed JSON (walked without recursion)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest
