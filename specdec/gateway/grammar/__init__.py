"""Structured output: what a request's completion must match (`spec`), compiled once per
grammar (`compiler`), and each request's walk through its grammar (`state`)."""

from specdec.gateway.grammar.compiler import GrammarCompiler
from specdec.gateway.grammar.spec import (
    Choice,
    JsonObject,
    JsonSchema,
    Lark,
    Regex,
    StructuredOutput,
    structured_output_from_pb,
)
from specdec.gateway.grammar.state import RequestGrammar

__all__ = [
    "Choice", "GrammarCompiler", "JsonObject", "JsonSchema", "Lark", "Regex", "RequestGrammar",
    "StructuredOutput", "structured_output_from_pb",
]
