"""The gateway's `GenerateResponse` messages as OpenAI response bodies and stream chunks.

One `Reply` per request: `chunks` maps each streamed message to its server-sent chunks,
`add` + `body` collect a whole response. The final chunk (the one with `finish_reason`) and
the whole response carry the vendor field `speculation` (`speculation_stats`). A request that
asks for logprobs gets them in OpenAI's form for its endpoint (`Logprobs`): chat's `content`
list, completions' parallel lists.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from specdec.gateway.openai.protocol import Endpoint, OpenAIRequest
from specdec.gateway.tools import CallDelta, Delta, ToolCall, read_whole
from specdec.v1 import gateway_pb2

FINISH_REASONS = {
    gateway_pb2.FINISH_REASON_STOP: "stop",
    gateway_pb2.FINISH_REASON_LENGTH: "length",
    gateway_pb2.FINISH_REASON_CANCELLED: "cancelled",
    gateway_pb2.FINISH_REASON_ERROR: "error",
}


def is_failure(response: gateway_pb2.GenerateResponse) -> bool:
    """The final message of a request that failed (its error message says why)."""
    return response.HasField("completion") and response.completion.finish_reason == gateway_pb2.FINISH_REASON_ERROR


def usage(completion: gateway_pb2.Completion) -> dict[str, int]:
    prompt, generated = completion.usage.prompt_tokens, completion.usage.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def speculation_stats(completion: gateway_pb2.Completion) -> dict[str, float | int]:
    """The request's speculation, named after vLLM's spec-decode counters (`num_drafts`: rounds
    that drafted; the `lookup` share came from lookups instead of the draft model)."""
    stats = completion.speculation
    return {
        "num_drafts": stats.num_rounds,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "acceptance_rate": stats.acceptance_rate,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "num_plain_rounds": stats.num_plain_rounds,
        "num_lookup_drafts": stats.num_lookup_rounds,
        "num_lookup_draft_tokens": stats.num_lookup_draft_tokens,
        "num_lookup_accepted_tokens": stats.num_lookup_accepted_tokens,
        "num_guided_drafts": stats.num_guided_rounds,
        "num_guessed_tokens": stats.num_guessed_tokens,
        "num_forced_tokens": stats.num_forced_tokens,
    }


#: JSON has no -inf: a token a transform ruled out (processed logprobs) gets this, as in vLLM.
LOGPROB_FLOOR = -9999.0
#: A token's text (its decoding alone), by id.
TokenText = Callable[[int], str]


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR) if not math.isnan(value) else LOGPROB_FLOOR


class Logprobs:
    """The logprobs of a response's tokens in OpenAI's form for its endpoint."""

    def __init__(self, endpoint: Endpoint, token_text: TokenText) -> None:
        self.endpoint = endpoint
        self.token_text = token_text
        self.offset = 0  # completions' text_offset: characters before the next token

    def of(self, tokens: list[gateway_pb2.TokenLogprob]) -> dict[str, Any]:
        """Chat: {"content": [{token, logprob, bytes, top_logprobs}], "refusal"}; completions:
        {"tokens", "token_logprobs", "top_logprobs" (text -> logprob), "text_offset"}."""
        if self.endpoint is Endpoint.CHAT:
            return {"content": [self._entry(t.token_id, t.logprob) | {"top_logprobs": [
                self._entry(top.token_id, top.logprob) for top in t.top]} for t in tokens], "refusal": None}
        texts = [self.token_text(t.token_id) for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": texts, "token_logprobs": [_logprob(t.logprob) for t in tokens],
                "top_logprobs": [{self.token_text(top.token_id): _logprob(top.logprob) for top in t.top}
                                 for t in tokens], "text_offset": offsets}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode())}

    @staticmethod
    def joined(parts: list[dict[str, Any]]) -> dict[str, Any]:
        """One response's logprobs from those of its messages (`of`), in order."""
        if not parts:
            return {}
        return {key: None if key == "refusal" else [x for part in parts for x in part[key]] for key in parts[0]}


class Reply:
    """The response to one request, as chunks (streaming) or one body."""

    def __init__(self, request: OpenAIRequest, model: str, token_text: TokenText) -> None:
        self.endpoint = request.endpoint
        #: Reads tool calls out of the answer (None: the answer is all content).
        self.tools = request.tool_reader() if request.tool_reader is not None else None
        self.include_usage = request.include_usage
        self.model = model
        #: None when the request asked for no logprobs.
        self.logprobs = Logprobs(request.endpoint, token_text) if request.generate.HasField("logprobs") else None
        self.logprob_parts: list[dict[str, Any]] = []
        chat = self.endpoint is Endpoint.CHAT
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.text: list[str] = []
        self.completion: gateway_pb2.Completion | None = None
        self._role_sent = False

    def chunks(self, response: gateway_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """The chunks of one streamed message: its text (the first chunk of a chat also says
        the role), then, on the final message, the finish reason with the speculation statistics
        and, with `include_usage`, a last chunk with the usage and no choices."""
        chunks = []
        if response.text or response.token_ids:
            logprobs = self._logprobs_of(response)
            for i, fields in enumerate(self._message_deltas(response.text)):
                chunks.append(self._chunk(self._delta(fields), None, logprobs if i == 0 else None))
        if response.HasField("completion"):
            completion = response.completion
            if self.tools is not None:
                chunks.extend(self._chunk(self._delta(fields), None) for fields in _merged(self.tools.finish()))
            final = self._chunk(self._delta({}), self._finish_reason(completion))
            final["speculation"] = speculation_stats(completion)
            chunks.append(final)
            if self.include_usage:
                chunks.append({**self._envelope(), "choices": [], "usage": usage(completion)})
        return chunks

    def add(self, response: gateway_pb2.GenerateResponse) -> None:
        """Collect a message of a response that is answered whole (`body`)."""
        self.text.append(response.text)
        if (logprobs := self._logprobs_of(response)) is not None:
            self.logprob_parts.append(logprobs)
        if response.HasField("completion"):
            self.completion = response.completion

    def body(self) -> dict[str, Any]:
        """The whole response, once `add` saw the final message."""
        if self.completion is None:
            raise RuntimeError("the response has not finished")
        text = "".join(self.text)
        logprobs = None if self.logprobs is None else Logprobs.joined(self.logprob_parts) or self.logprobs.of([])
        choice: dict[str, Any] = {"index": 0, "logprobs": logprobs}
        if self.tools is not None:
            answer = read_whole(text, self.tools)
            choice["message"] = {"role": "assistant", "content": answer.content}
            if answer.tool_calls:
                choice["message"]["tool_calls"] = [_call(call) for call in answer.tool_calls]
        elif self.endpoint is Endpoint.CHAT:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["finish_reason"] = self._finish_reason(self.completion)
        return {**self._envelope(self.endpoint.value), "choices": [choice], "usage": usage(self.completion),
                "speculation": speculation_stats(self.completion)}

    def _envelope(self, kind: str | None = None) -> dict[str, Any]:
        if kind is None:  # a stream chunk
            kind = "chat.completion.chunk" if self.endpoint is Endpoint.CHAT else Endpoint.COMPLETIONS.value
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _finish_reason(self, completion: gateway_pb2.Completion) -> str:
        """An answer that made calls and ended by itself (not cut by length) ends with tool_calls."""
        if self.tools is not None and self.tools.calls and completion.finish_reason == gateway_pb2.FINISH_REASON_STOP:
            return "tool_calls"
        return FINISH_REASONS[completion.finish_reason]

    def _message_deltas(self, text: str) -> list[dict[str, Any]]:
        """The delta fields of one streamed message's text: its content, or what the tool reader
        made of it (an empty delta when it holds the text back)."""
        if self.tools is None:
            return [{"content": text}]
        return _merged(self.tools.feed(text)) or [{}]

    def _delta(self, fields: dict[str, Any]) -> dict[str, Any]:
        """A chat delta of `fields` (content, tool_calls; {}: an empty one) or a completion's text."""
        if self.endpoint is Endpoint.COMPLETIONS:
            return {"text": fields.get("content", "")}
        delta = dict(fields)
        if not self._role_sent:
            delta["role"] = "assistant"
            self._role_sent = True
        return {"delta": delta}

    def _logprobs_of(self, response: gateway_pb2.GenerateResponse) -> dict[str, Any] | None:
        if self.logprobs is None or not response.token_ids:
            return None
        return self.logprobs.of(list(response.logprobs))

    def _chunk(self, choice: dict[str, Any], finish_reason: str | None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        chunk = {**self._envelope(), "choices": [{"index": 0, **choice, "logprobs": logprobs,
                                                  "finish_reason": finish_reason}]}
        if self.include_usage:
            chunk["usage"] = None  # OpenAI's chunks say so until the last one
        return chunk


def _merged(deltas: list[Delta]) -> list[dict[str, Any]]:
    """Delta fields of a reader's deltas: adjacent content joined, each piece of a call its own."""
    fields: list[dict[str, Any]] = []
    for delta in deltas:
        if isinstance(delta, str):
            if fields and "content" in fields[-1]:
                fields[-1]["content"] += delta
            else:
                fields.append({"content": delta})
        else:
            fields.append({"tool_calls": [_call_delta(delta)]})
    return fields


def _call_delta(delta: CallDelta) -> dict[str, Any]:
    """A streamed call piece: the first names the call (id, type, name), the rest only add arguments."""
    if delta.call is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    return {"index": delta.index, **_call(delta.call), "function": {"name": delta.call.name,
                                                                   "arguments": delta.arguments}}


def _call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
