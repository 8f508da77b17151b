"""The gateway's `GenerateResponse` messages as OpenAI response bodies and stream chunks.

One `Reply` per request: `chunks` maps each streamed message to its server-sent chunks,
`add` + `body` collect a whole response. The final chunk (the one with `finish_reason`) and
the whole response carry the vendor field `speculation` (`speculation_stats`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from specdec.gateway.openai.protocol import Endpoint, OpenAIRequest
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
    }


class Reply:
    """The response to one request, as chunks (streaming) or one body."""

    def __init__(self, request: OpenAIRequest, model: str) -> None:
        self.endpoint = request.endpoint
        self.include_usage = request.include_usage
        self.model = model
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
            chunks.append(self._chunk(self._delta(response.text), None))
        if response.HasField("completion"):
            completion = response.completion
            final = self._chunk(self._delta(None), FINISH_REASONS[completion.finish_reason])
            final["speculation"] = speculation_stats(completion)
            chunks.append(final)
            if self.include_usage:
                chunks.append({**self._envelope(), "choices": [], "usage": usage(completion)})
        return chunks

    def add(self, response: gateway_pb2.GenerateResponse) -> None:
        """Collect a message of a response that is answered whole (`body`)."""
        self.text.append(response.text)
        if response.HasField("completion"):
            self.completion = response.completion

    def body(self) -> dict[str, Any]:
        """The whole response, once `add` saw the final message."""
        if self.completion is None:
            raise RuntimeError("the response has not finished")
        text = "".join(self.text)
        choice: dict[str, Any] = {"index": 0, "logprobs": None,
                                  "finish_reason": FINISH_REASONS[self.completion.finish_reason]}
        if self.endpoint is Endpoint.CHAT:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._envelope(self.endpoint.value), "choices": [choice], "usage": usage(self.completion),
                "speculation": speculation_stats(self.completion)}

    def _envelope(self, kind: str | None = None) -> dict[str, Any]:
        if kind is None:  # a stream chunk
            kind = "chat.completion.chunk" if self.endpoint is Endpoint.CHAT else Endpoint.COMPLETIONS.value
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _delta(self, text: str | None) -> dict[str, Any]:
        """A chat delta (`text` None: an empty one) or a completion's text."""
        if self.endpoint is Endpoint.COMPLETIONS:
            return {"text": text or ""}
        delta: dict[str, Any] = {} if text is None else {"content": text}
        if not self._role_sent:
            delta["role"] = "assistant"
            self._role_sent = True
        return {"delta": delta}

    def _chunk(self, choice: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        chunk = {**self._envelope(), "choices": [{"index": 0, **choice, "logprobs": None,
                                                  "finish_reason": finish_reason}]}
        if self.include_usage:
            chunk["usage"] = None  # OpenAI's chunks say so until the last one
        return chunk
