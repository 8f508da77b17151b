"""Tool calling on any model (docs/openai.md#tools): the request's tools described in the prompt
and its history rendered in the model family's tool format (`prompt`, `hermes`, `llama3_json`),
a grammar where the tool choice forces a call, and the calls read back out of the answer, whole
or as it streams (`reader`). Nothing here knows HTTP: the OpenAI front builds on it.
"""

from specdec.gateway.tools.family import PARSER_CHOICES, choose_format
from specdec.gateway.tools.formats import ToolFormat
from specdec.gateway.tools.prompt import MAX_PARALLEL_CALLS, render_messages, structured_output
from specdec.gateway.tools.reader import Answer, CallDelta, Delta, OutputReader, read_whole, reader_for
from specdec.gateway.tools.types import (
    AutoCalls,
    Message,
    NamedCall,
    NoCalls,
    RequiredCalls,
    Tool,
    ToolCall,
    ToolChoice,
    ToolUse,
)

__all__ = [
    "MAX_PARALLEL_CALLS", "PARSER_CHOICES", "Answer", "AutoCalls", "CallDelta", "Delta", "Message", "NamedCall",
    "NoCalls", "OutputReader", "RequiredCalls", "Tool", "ToolCall", "ToolChoice", "ToolFormat", "ToolUse",
    "choose_format", "read_whole", "reader_for", "render_messages", "structured_output",
]
