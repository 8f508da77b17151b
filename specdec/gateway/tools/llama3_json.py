"""The `llama3_json` tool format, Meta's JSON tool calling for Llama 3.1 / 3.2: the tools are
described in the system prompt, and an answer that calls is nothing but the call, a JSON object
with the function's `name` and its `parameters` (several separated by `;`; a leading
`<|python_tag|>` is read too):

    {"name": "get_weather", "parameters": {"city": "Paris"}}

A tool's result goes back as an `ipython` message, the role Llama 3 reads tool output in.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence

from specdec.gateway.tools.formats import Piece, Scanner, ToolFormat
from specdec.gateway.tools.types import Tool, ToolCall

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class Llama3Json(ToolFormat):
    name = "llama3_json"
    arguments_key = "parameters"
    result_role = "ipython"

    def system_text(self, tools: Sequence[Tool]) -> str:
        listed = "\n\n".join(tool.description_json() for tool in tools)
        return (
            "You have access to the functions below, each described by a JSON object (its parameters as a "
            "JSON Schema). To call one, your whole answer is a JSON object naming it and giving its "
            'argument values, {"name": "<function name>", "parameters": {<argument values>}}, with no other '
            "text; several calls are separated by \"; \". Answer in plain text when no function is needed."
            f"\n\n{listed}"
        )

    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        return f"{SEPARATOR} ".join(self.call_json(call) for call in calls)

    def render_result(self, content: str) -> str:
        return content

    def calls_grammar(self, call_rules: Sequence[str], max_calls: int) -> str:
        start = "start: call" + (f' ("{SEPARATOR} " call){{0,{max_calls - 1}}}' if max_calls > 1 else "")
        return f"{start}\ncall: {' | '.join(call_rules)}"

    def scanner(self, names: Collection[str]) -> Scanner:
        return _WholeAnswerScanner(self, names)

    def parse_calls(self, text: str, names: Collection[str]) -> list[ToolCall] | None:
        """The calls that make up all of `text`, or None when it is anything else."""
        text = text.strip().removeprefix(PYTHON_TAG)
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        at = 0
        while True:
            at = _skip_blanks(text, at)
            try:
                value, at = decoder.raw_decode(text, at)
            except (ValueError, RecursionError):
                return None
            if (call := self.call_from(value, names)) is None:
                return None
            calls.append(call)
            at = _skip_blanks(text, at)
            if at == len(text):
                return calls
            if text[at] != SEPARATOR:
                return None
            at += 1


class _WholeAnswerScanner:
    """An answer that begins with `{` (or the python tag) may be calls: it is held whole and
    read at `finish`, content if it is not only calls. Any other answer is content as it comes."""

    def __init__(self, form: Llama3Json, names: Collection[str]) -> None:
        self.form, self.names = form, names
        self.pending = ""
        self.text = False  # decided: the answer is content

    def feed(self, text: str) -> list[Piece]:
        if self.text:
            return [text] if text else []
        self.pending += text
        head = self.pending.lstrip()
        if not head or head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head):
            return []
        self.text = True
        rest, self.pending = self.pending, ""
        return [rest]

    def finish(self) -> list[Piece]:
        rest, self.pending = self.pending, ""
        if not rest:
            return []
        calls = None if self.text else self.form.parse_calls(rest, self.names)
        return list(calls) if calls else [rest]


def _skip_blanks(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at
