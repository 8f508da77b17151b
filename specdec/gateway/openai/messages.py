"""A chat body's `messages` as the gateway's `ChatMessages`: text content, and an assistant's
`tool_calls` and a `tool` message's result rendered in the served model's tool format
(`specdec.gateway.tools`), with the request's tools described in the system message."""

from __future__ import annotations

import json
from typing import Any

from specdec.gateway.intake import CHAT_ROLES
from specdec.gateway.openai.errors import invalid_field, not_supported
from specdec.gateway.openai.fields import json_type
from specdec.gateway.tools import Message, ToolCall, ToolFormat, ToolUse, render_messages
from specdec.gateway.tools.types import new_call_id
from specdec.v1 import gateway_pb2

#: OpenAI's newer role for system instructions; the chat templates know it as `system`.
ROLE_ALIASES = {"developer": "system"}


def chat_from_body(body: dict[str, Any], use: ToolUse | None, form: ToolFormat) -> gateway_pb2.ChatMessages:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_field("messages", "must be a non-empty list of messages")
    parsed = [message_from_body(message, f"messages[{i}]") for i, message in enumerate(messages)]
    chat = gateway_pb2.ChatMessages()
    for role, content in render_messages(parsed, use, form):
        chat.messages.add(role=role, content=content)
    return chat


def message_from_body(message: object, param: str) -> Message:
    if not isinstance(message, dict):
        raise invalid_field(param, "must be an object with a role and a content")
    role = message.get("role")
    if not isinstance(role, str):
        raise invalid_field(f"{param}.role", "must be a string")
    role = ROLE_ALIASES.get(role, role)
    if role not in CHAT_ROLES:  # here, not by the gateway: a tools system message may shift the indices
        raise invalid_field(f"{param}.role", f"{role!r} is not one of {', '.join(CHAT_ROLES)}")
    calls = calls_from_body(message.get("tool_calls"), f"{param}.tool_calls") if role == "assistant" else ()
    content = message.get("content")
    text = "" if content is None and role == "assistant" else message_text(content, f"{param}.content")
    call_id = message.get("tool_call_id", "")
    if role == "tool" and not isinstance(call_id, str):
        raise invalid_field(f"{param}.tool_call_id", f"must be a string, got {json_type(call_id)}")
    return Message(role, text, calls, call_id if role == "tool" else "")


def calls_from_body(calls: object, param: str) -> tuple[ToolCall, ...]:
    """An assistant message's `tool_calls`: `{id, type: "function", function: {name, arguments}}`
    each, the arguments JSON text (an object is taken too)."""
    if calls is None:
        return ()
    if not isinstance(calls, list):
        raise invalid_field(param, "must be a list of tool calls")
    return tuple(call_from_body(call, f"{param}[{i}]") for i, call in enumerate(calls))


def call_from_body(call: object, param: str) -> ToolCall:
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        raise invalid_field(param, 'must be a tool call: {"type": "function", "function": {"name", "arguments"}}')
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(name := function.get("name"), str) or not name:
        raise invalid_field(f"{param}.function.name", "must be a non-empty string")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise invalid_field(f"{param}.function.arguments", f"must be a JSON string, got {json_type(arguments)}")
    call_id = call.get("id")
    return ToolCall(name, arguments, call_id if isinstance(call_id, str) and call_id else new_call_id())


def message_text(content: object, param: str) -> str:
    """A message's text: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(text, str) for text in texts):
            return "".join(str(text) for text in texts)
        raise not_supported(param, "only text content parts are supported")
    raise invalid_field(param, "must be a string or a list of text parts")
