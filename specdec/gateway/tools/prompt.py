"""A tool-using request as the gateway takes any request: its messages rendered in the model's
tool format (plain role and content, for the chat template), and the grammar its tool choice
imposes (`GenerateRequest.structured_output`)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from specdec.gateway.tools.formats import ToolFormat
from specdec.gateway.tools.types import Message, NamedCall, NoCalls, RequiredCalls, ToolUse
from specdec.v1 import gateway_pb2

#: The most calls `required` lets one answer make (with parallel calls; one without).
MAX_PARALLEL_CALLS = 8


def render_messages(messages: Sequence[Message], use: ToolUse | None, form: ToolFormat) -> list[tuple[str, str]]:
    """(role, content) pairs: calls and tool results in `form`, and the tools described at the
    end of the system message (one is added first if there is none), unless the choice is `none`."""
    rendered = [render_message(message, form) for message in messages]
    if use is None or not use.tools or isinstance(use.choice, NoCalls):
        return rendered
    text = form.system_text(use.tools)
    if rendered and rendered[0][0] == "system":
        rendered[0] = ("system", f"{rendered[0][1]}\n\n{text}" if rendered[0][1] else text)
    else:
        rendered.insert(0, ("system", text))
    return rendered


def render_message(message: Message, form: ToolFormat) -> tuple[str, str]:
    if message.role == "tool":
        return form.result_role, form.render_result(message.content)
    if message.tool_calls:
        calls = form.render_calls(message.tool_calls)
        return message.role, f"{message.content}\n{calls}" if message.content else calls
    return message.role, message.content


def structured_output(use: ToolUse, form: ToolFormat) -> gateway_pb2.StructuredOutput | None:
    """The grammar of a forced call: a named function's arguments object (JSON Schema), or for
    `required` one call or more (up to MAX_PARALLEL_CALLS) of any tool in `form`'s syntax (Lark).
    None for `auto` and `none`."""
    match use.choice:
        case NamedCall(name=name):
            tool = use.tool(name)
            if tool is None:
                raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
            return gateway_pb2.StructuredOutput(json_schema=json.dumps(tool.arguments_schema()))
        case RequiredCalls():
            max_calls = MAX_PARALLEL_CALLS if use.parallel else 1
            return gateway_pb2.StructuredOutput(grammar=form.grammar(use.tools, max_calls))
    return None
