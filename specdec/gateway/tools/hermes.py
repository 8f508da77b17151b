"""The `hermes` tool format, for ChatML models (SmolLM2, Qwen, Hermes): the tools are listed in
the system prompt between `<tools>` tags, and each call is a JSON object between `<tool_call>`
tags, anywhere in the answer, several one after the other:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A tool's result goes back as a `tool` message wrapped in `<tool_response>` tags.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence

from specdec.gateway.tools.formats import Piece, Scanner, ToolFormat
from specdec.gateway.tools.types import Tool, ToolCall

START, END = "<tool_call>", "</tool_call>"


class Hermes(ToolFormat):
    name = "hermes"
    arguments_key = "arguments"
    result_role = "tool"

    def system_text(self, tools: Sequence[Tool]) -> str:
        listed = "\n".join(tool.description_json() for tool in tools)
        return (
            "# Tools\n\nThese functions are available, each described by a JSON object (its parameters "
            f"as a JSON Schema):\n<tools>\n{listed}\n</tools>\n\n"
            f"To call a function, write {START} on a line, then a JSON object with its \"name\" and its "
            f"\"arguments\", then {END} on a line:\n{START}\n"
            '{"name": "<function name>", "arguments": {<argument values>}}\n'
            f"{END}\nSeveral calls go one after the other. Without a call, answer in plain text."
        )

    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        return "\n".join(f"{START}\n{self.call_json(call)}\n{END}" for call in calls)

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def calls_grammar(self, call_rules: Sequence[str], max_calls: int) -> str:
        start = "start: call" + (f' ("\\n" call){{0,{max_calls - 1}}}' if max_calls > 1 else "")
        return f'{start}\ncall: "{START}\\n" ({" | ".join(call_rules)}) "\\n{END}"'

    def scanner(self, names: Collection[str]) -> Scanner:
        return _TagScanner(self, names)


class _TagScanner:
    """Text outside the tags is content as soon as no tag can start in it; a tagged block is
    held until its end tag, then handed on as a call, or as content when it holds no valid call
    (no JSON, an unknown tool). A block the answer leaves open is read at `finish` the same way."""

    def __init__(self, form: ToolFormat, names: Collection[str]) -> None:
        self.form, self.names = form, names
        self.pending = ""

    def feed(self, text: str) -> list[Piece]:
        self.pending += text
        pieces: list[Piece] = []
        while (start := self.pending.find(START)) >= 0:
            pieces.append(self.pending[:start])
            end = self.pending.find(END, start)
            if end < 0:
                self.pending = self.pending[start:]
                return [piece for piece in pieces if piece]
            block = self.pending[start:end + len(END)]
            pieces.append(self._call(block[len(START):-len(END)]) or block)
            self.pending = self.pending[end + len(END):]
        held = _partial_tag(self.pending)
        pieces.append(self.pending[:len(self.pending) - held])
        self.pending = self.pending[len(self.pending) - held:]
        return [piece for piece in pieces if piece]

    def finish(self) -> list[Piece]:
        rest, self.pending = self.pending, ""
        if rest.startswith(START):
            return [self._call(rest[len(START):]) or rest]
        return [rest] if rest else []

    def _call(self, body: str) -> ToolCall | None:
        try:
            return self.form.call_from(json.loads(body), self.names)
        except (ValueError, RecursionError):
            return None


def _partial_tag(text: str) -> int:
    """The length of the longest end of `text` that begins the start tag (held: it may be one)."""
    for length in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-length:]):
            return length
    return 0
