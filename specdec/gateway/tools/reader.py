"""Reading a tool-using answer as it streams: text in, content and call deltas out, in order.

A call's first delta carries its id and name (`CallDelta.call`), later ones only more of its
arguments text, as OpenAI streams `tool_calls`. `Answer` joins the deltas into the whole message.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from specdec.gateway.tools.formats import Scanner, ToolFormat
from specdec.gateway.tools.types import AutoCalls, NamedCall, NoCalls, RequiredCalls, ToolCall, ToolUse


@dataclass(frozen=True)
class CallDelta:
    """Arguments text of the call at `index` (0, 1, ... in the answer); `call` on its first delta."""

    index: int
    arguments: str
    call: ToolCall | None = None


#: Content text, or a piece of a call.
Delta = str | CallDelta


class OutputReader(Protocol):
    """`feed` each piece of the answer's text, then `finish` once; `calls`: calls read so far."""

    calls: int

    def feed(self, text: str) -> list[Delta]: ...

    def finish(self) -> list[Delta]: ...


class CallsReader:
    """`auto` and `required`: calls in the format's syntax, read whole by its scanner. Without
    `parallel`, calls after the first are dropped; blank content after a call is too (the gaps
    between calls)."""

    def __init__(self, scanner: Scanner, parallel: bool) -> None:
        self.scanner, self.parallel = scanner, parallel
        self.calls = 0

    def feed(self, text: str) -> list[Delta]:
        return self._deltas(self.scanner.feed(text))

    def finish(self) -> list[Delta]:
        return self._deltas(self.scanner.finish())

    def _deltas(self, pieces: Iterable[str | ToolCall]) -> list[Delta]:
        deltas: list[Delta] = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                if self.calls == 0 or self.parallel:
                    deltas.append(CallDelta(self.calls, piece.arguments, piece))
                    self.calls += 1
            elif not (self.calls and piece.isspace()):
                deltas.append(piece)
        return deltas


class NamedReader:
    """A named function: the whole answer is its arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        self.call = ToolCall(name, "")
        self.calls = 0

    def feed(self, text: str) -> list[Delta]:
        if not text:
            return []
        first = self.calls == 0
        self.calls = 1
        return [CallDelta(0, text, self.call if first else None)]

    def finish(self) -> list[Delta]:
        if self.calls:
            return []
        self.calls = 1
        return [CallDelta(0, "", self.call)]


def reader_for(use: ToolUse, form: ToolFormat) -> OutputReader | None:
    """The reader of an answer under `use` (None under `none`: the answer is plain content)."""
    match use.choice:
        case NamedCall(name=name):
            return NamedReader(name)
        case AutoCalls() | RequiredCalls():
            return CallsReader(form.scanner(use.names), use.parallel)
        case NoCalls():
            return None
    raise TypeError(f"unknown tool choice {use.choice!r}")


@dataclass
class Answer:
    """A whole answer from its deltas: the content (None when blank) and the calls."""

    content_parts: list[str] = field(default_factory=list)
    headers: list[ToolCall] = field(default_factory=list)
    arguments: list[list[str]] = field(default_factory=list)

    def add(self, deltas: Iterable[Delta]) -> None:
        for delta in deltas:
            if isinstance(delta, str):
                self.content_parts.append(delta)
            elif delta.call is not None:
                self.headers.append(delta.call)
                self.arguments.append([delta.arguments])
            else:
                self.arguments[delta.index].append(delta.arguments)

    @property
    def content(self) -> str | None:
        content = "".join(self.content_parts)
        return content if content.strip() or not self.headers else None

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(header.name, "".join(parts), header.id) for header, parts in zip(self.headers, self.arguments)]


def read_whole(text: str, reader: OutputReader) -> Answer:
    """A whole answer's text read at once."""
    answer = Answer()
    answer.add(reader.feed(text))
    answer.add(reader.finish())
    return answer
