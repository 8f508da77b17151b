"""An OpenAI request body as the gateway's `GenerateRequest` (docs/openai.md lists the fields).

This module checks only what JSON can get wrong that protobuf cannot (types, and a value out
of a field's range before it is converted); everything else (roles, lengths, stop strings, the
speculation options, sampling ranges) is validated once, by `intake.new_request`, for both
fronts, and `in_body_terms` names the OpenAI field its errors point at (`InvalidArgumentError.field`).

Unknown fields are ignored, as OpenAI-compatible servers do; known fields this server does not
implement are refused unless they carry their no-op value, so nothing asked for is dropped.
"""

from __future__ import annotations

import enum
import functools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from specdec.errors import InvalidArgumentError, SpecdecError
from specdec.gateway.openai.errors import OpenAIError, invalid_field, not_supported
from specdec.gateway.openai.fields import INT32_MAX, boolean, integer, json_type
from specdec.gateway.openai.generation_fields import sampling_from_body, speculation_from_body, stop_from_body
from specdec.gateway.openai.messages import chat_from_body
from specdec.gateway.openai.tool_fields import tool_use_from_body
from specdec.gateway.tools import NamedCall, NoCalls, OutputReader, ToolFormat, ToolUse, reader_for, structured_output
from specdec.gateway.tools.hermes import Hermes
from specdec.sampling.logprobs import MAX_TOP_LOGPROBS
from specdec.v1 import gateway_pb2

#: `logprobs_mode` (vLLM's names): the model's raw distribution, or the one after the
#: request's transforms (`LogprobsOptions.processed`).
LOGPROBS_MODES = {"raw_logprobs": False, "processed_logprobs": True}
#: Fields of OpenAI's API this server does not implement, with their no-op values.
UNSUPPORTED_FIELDS: dict[str, tuple[object, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
}


#: A fresh reader of one answer's tool calls.
ToolReaderFactory = Callable[[], OutputReader | None]


class Endpoint(enum.Enum):
    CHAT = "chat.completion"
    COMPLETIONS = "text_completion"


@dataclass(frozen=True)
class ServedModel:
    """The model this server answers for: `name` is its id in /v1/models and in responses; a
    request may name it by any of `aliases` (the name and the id it was loaded from)."""

    name: str
    aliases: frozenset[str]
    max_model_len: int
    #: How the model writes tool calls (`specdec.gateway.tools.choose_format`).
    tool_format: ToolFormat = field(default_factory=Hermes)


@dataclass(frozen=True)
class OpenAIRequest:
    endpoint: Endpoint
    generate: gateway_pb2.GenerateRequest
    stream: bool
    #: `stream_options.include_usage`: a last chunk with the usage and no choices.
    include_usage: bool
    #: Makes the reader of the answer's tool calls (None: the answer is plain content).
    tool_reader: ToolReaderFactory | None = None
    #: gRPC field -> the body's field it came from, where it is not the usual one (`body_field`).
    renames: Mapping[str, str] = field(default_factory=dict)


def parse_request(body: object, endpoint: Endpoint, model: ServedModel) -> OpenAIRequest:
    """The body as a `GenerateRequest`; OpenAIError (400 naming the field, 404 for another model)."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    check_model(body, model)
    refuse_unsupported(body)
    max_tokens_name, max_new_tokens = max_new_tokens_from_body(body, endpoint)
    request = gateway_pb2.GenerateRequest(
        max_new_tokens=max_new_tokens,
        sampling=sampling_from_body(body),
        stop=stop_from_body(body),
        speculation=speculation_from_body(body.get("speculation")),
        refuse_past_context=True,
    )
    if (logprobs := logprobs_from_body(body, endpoint)) is not None:
        request.logprobs.CopyFrom(logprobs)
    if (output := response_format_from_body(body)) is not None:
        request.structured_output.CopyFrom(output)
    renames = {"max_new_tokens": max_tokens_name}
    reader = None
    if endpoint is Endpoint.CHAT:
        use = tool_use_from_body(body)
        request.chat.CopyFrom(chat_from_body(body, use, model.tool_format))
        if use is not None:
            reader = apply_tool_choice(request, use, model.tool_format, renames)
    else:
        for name in ("tools", "tool_choice"):
            if body.get(name) not in (None, [], "none"):
                raise not_supported(name, "tools are for /v1/chat/completions")
        request.prompt = prompt_from_body(body)
    stream = boolean(body, "stream") or False
    return OpenAIRequest(endpoint, request, stream, include_usage_from_body(body, stream), reader, renames)


def apply_tool_choice(request: gateway_pb2.GenerateRequest, use: ToolUse, form: ToolFormat,
                      renames: dict[str, str]) -> ToolReaderFactory | None:
    """The grammar a forced call needs, set on `request`, and the reader of the answer's calls
    (None under `none`). A `response_format` beside calls is a 400: an answer cannot be both."""
    if isinstance(use.choice, NoCalls):
        return None
    if request.HasField("structured_output"):
        raise invalid_field("response_format", "cannot be combined with tools unless tool_choice is none")
    if (output := structured_output(use, form)) is not None:
        request.structured_output.CopyFrom(output)
        renames["structured_output.grammar"] = "tools"
        if isinstance(use.choice, NamedCall):
            index = [tool.name for tool in use.tools].index(use.choice.name)
            renames["structured_output.json_schema"] = f"tools[{index}].function.parameters"
    return functools.partial(reader_for, use, form)


def check_model(body: dict[str, Any], model: ServedModel) -> None:
    """An absent or empty `model` means the served one (there is only one)."""
    name = body.get("model")
    if name is None or name == "":
        return
    if not isinstance(name, str):
        raise invalid_field("model", "must be a string")
    if name not in model.aliases:
        raise OpenAIError(404, f"the model {name!r} does not exist; this server serves {model.name!r}",
                          param="model", code="model_not_found")


def refuse_unsupported(body: dict[str, Any]) -> None:
    for name, no_ops in UNSUPPORTED_FIELDS.items():
        if name in body and not _is_one_of(body[name], no_ops):
            raise not_supported(name)
    n = integer(body, "n")
    if n is not None and n != 1:
        raise not_supported("n", f"only n = 1 is supported (one choice a request), got {n}")


def _is_one_of(value: object, no_ops: tuple[object, ...]) -> bool:
    return any(type(value) is type(no_op) and value == no_op for no_op in no_ops)


def max_new_tokens_from_body(body: dict[str, Any], endpoint: Endpoint) -> tuple[str, int]:
    """The field given, `max_completion_tokens` (chat) or `max_tokens`, and its value; 0 (unset)
    is the gateway's default. More than the context leaves after the prompt is refused (by the
    gateway, which counts the prompt: `GenerateRequest.refuse_past_context`)."""
    names = ("max_completion_tokens", "max_tokens") if endpoint is Endpoint.CHAT else ("max_tokens",)
    for name in names:
        value = integer(body, name, low=1)
        if value is not None:
            return name, min(value, INT32_MAX)
    return "max_tokens", 0


def logprobs_from_body(body: dict[str, Any], endpoint: Endpoint) -> gateway_pb2.LogprobsOptions | None:
    """What the request asks of its tokens' logprobs: chat's `logprobs` (a boolean) with
    `top_logprobs`, completions' `logprobs` (the number of alternatives), and `logprobs_mode`.
    None when it asks for none."""
    if endpoint is Endpoint.CHAT:
        top = integer(body, "top_logprobs", low=0, high=MAX_TOP_LOGPROBS)
        if not boolean(body, "logprobs"):
            if top:
                raise invalid_field("top_logprobs", "needs logprobs: true")
            return None
    else:
        top = integer(body, "logprobs", low=0, high=MAX_TOP_LOGPROBS)
        if top is None:
            return None
    mode = body.get("logprobs_mode", "raw_logprobs")
    if mode not in LOGPROBS_MODES:
        raise invalid_field("logprobs_mode", f"must be one of {', '.join(LOGPROBS_MODES)}, got {mode!r}")
    return gateway_pb2.LogprobsOptions(top_logprobs=top or 0, processed=LOGPROBS_MODES[mode])


def response_format_from_body(body: dict[str, Any]) -> gateway_pb2.StructuredOutput | None:
    """`response_format`: text (None), `json_object`, or `json_schema` with its `name` and
    `schema` (always enforced, `strict` or not)."""
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_field("response_format", f"must be an object, got {json_type(value)}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        output = gateway_pb2.StructuredOutput()
        output.json_object.SetInParent()
        return output
    if kind != "json_schema":
        raise invalid_field("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid_field("response_format.json_schema", "must be an object with a name and a schema")
    name = spec.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise invalid_field("response_format.json_schema.name",
                            "must be 1 to 64 letters, digits, underscores or dashes")
    boolean(spec, "strict", "response_format.json_schema.")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise invalid_field("response_format.json_schema.schema", f"must be an object, got {json_type(schema)}")
    return gateway_pb2.StructuredOutput(json_schema=json.dumps(schema))


def prompt_from_body(body: dict[str, Any]) -> str:
    """One text prompt: a string, or a list holding one string."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raise not_supported("prompt", f"one prompt a request, got a list of {len(prompt)}")
    if isinstance(prompt, list) and prompt and not any(isinstance(p, str) for p in prompt):
        raise not_supported("prompt", "token-id prompts are not supported: send text")
    raise invalid_field("prompt", "must be a string (or a list of one string)")


def include_usage_from_body(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid_field("stream_options", "is only allowed when stream is true")
    if not isinstance(options, dict):
        raise invalid_field("stream_options", "must be an object")
    return boolean(options, "include_usage", "stream_options.") or False


#: A `GenerateRequest` field -> the body's field, where the names differ on every request.
_BODY_FIELDS = {"max_new_tokens": "max_tokens", "structured_output.json_object": "response_format",
                "structured_output.json_schema": "response_format.json_schema.schema"}


def body_field(field: str, endpoint: Endpoint, renames: Mapping[str, str] | None = None) -> str:
    """The body's name for the `GenerateRequest` field an error is about
    (`InvalidArgumentError.field`): the request's own `renames` first (`OpenAIRequest.renames`),
    then the endpoint's prompt, then `_BODY_FIELDS`; a chat field drops its `chat.` prefix
    (`chat.messages[0].role` -> `messages[0].role`)."""
    if renames and field in renames:
        return renames[field]
    if field in ("prompt", "input"):
        return "messages" if endpoint is Endpoint.CHAT else "prompt"
    return _BODY_FIELDS.get(field, field.removeprefix("chat."))


def in_body_terms(error: SpecdecError, endpoint: Endpoint, renames: Mapping[str, str] | None = None,
                  ) -> tuple[str | None, str]:
    """The body field a refusal is about (None when it is about none) and its message naming it
    so; read from the error's `field`, never parsed out of its message."""
    if not isinstance(error, InvalidArgumentError) or error.field is None:
        return None, str(error)
    param = body_field(error.field, endpoint, renames)
    return param, error.named(param)
