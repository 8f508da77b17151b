"""Structured output at the gateway: what a request's completion must match (`spec`, turned into
grammar text that `specdec.grammar` compiles and walks) and its part in each round (`rounds`)."""

from specdec.gateway.grammar.spec import (
    Choice,
    JsonObject,
    JsonSchema,
    Lark,
    Regex,
    StructuredOutput,
    grammar_text,
    structured_output_from_pb,
)

__all__ = [
    "Choice", "JsonObject", "JsonSchema", "Lark", "Regex", "StructuredOutput", "grammar_text",
    "structured_output_from_pb",
]
