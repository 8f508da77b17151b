"""What a structured-output request asks for: one type per kind, each turned into the grammar
text llguidance compiles (`grammar`). Input is checked here, naming the field it came from."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance

from specdec.errors import InvalidArgumentError
from specdec.v1 import gateway_pb2

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

#: Compact JSON (no optional whitespace): a small model cannot loop on blanks, and the grammar
#: forces more of each answer's text. A schema's own `x-guidance` options override it.
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}
#: Bounds on what a request may send: a schema or grammar text, and the options of a choice.
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 1024
#: JSON nesting a schema may have (a deeper one is refused before it is parsed further).
MAX_SCHEMA_DEPTH = 64


@dataclass(frozen=True)
class JsonSchema:
    """A JSON Schema, as JSON text."""

    schema: str

    def grammar(self) -> str:
        return str(llguidance.LLMatcher.grammar_from_json_schema(self.schema, defaults=JSON_DEFAULTS))


@dataclass(frozen=True)
class JsonObject:
    """Any JSON object."""

    def grammar(self) -> str:
        return str(llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_DEFAULTS))


@dataclass(frozen=True)
class Regex:
    """The whole completion matches this regular expression."""

    pattern: str

    def grammar(self) -> str:
        return str(llguidance.LLMatcher.grammar_from_regex(self.pattern))


@dataclass(frozen=True)
class Choice:
    """Exactly one of these strings."""

    options: tuple[str, ...]

    def grammar(self) -> str:
        return llguidance.grammar_from("choice", json.dumps(list(self.options)))


@dataclass(frozen=True)
class Lark:
    """A context-free grammar in llguidance's Lark syntax (or GBNF)."""

    text: str

    def grammar(self) -> str:
        return llguidance.grammar_from("grammar", self.text)


StructuredOutput = JsonSchema | JsonObject | Regex | Choice | Lark


def grammar_text(output: StructuredOutput, field: str) -> str:
    """`output` as llguidance's grammar text; INVALID_ARGUMENT naming `field` where llguidance
    cannot translate it (a schema it does not read)."""
    try:
        return output.grammar()
    except (ValueError, TypeError) as error:
        raise InvalidArgumentError(f"{field}: {error}", field=field) from None


def structured_output_from_pb(message: gateway_pb2.StructuredOutput, field: str) -> StructuredOutput:
    """The request's kind, checked (INVALID_ARGUMENT naming `field`.<kind>)."""
    kind = message.WhichOneof("kind")
    where = f"{field}.{kind}"
    match kind:
        case "json_schema":
            return JsonSchema(_schema_text(message.json_schema, where))
        case "json_object":
            return JsonObject()
        case "regex":
            return Regex(_text(message.regex, where))
        case "choice":
            options = tuple(message.choice.options)
            if not options or len(options) > MAX_CHOICES or not all(options):
                raise InvalidArgumentError(f"{where}: give 1 to {MAX_CHOICES} options, none empty", field=where)
            _text("".join(options), where)
            return Choice(options)
        case "grammar":
            return Lark(_text(message.grammar, where))
    raise InvalidArgumentError(f"{field}: set one of json_schema, json_object, regex, choice, grammar", field=field)


def _text(text: str, where: str) -> str:
    if not text:
        raise InvalidArgumentError(f"{where}: empty", field=where)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidArgumentError(f"{where}: {len(text)} characters, above the limit of {MAX_GRAMMAR_CHARS}",
                                   field=where)
    return text


def _schema_text(text: str, where: str) -> str:
    """The schema as canonical JSON text (so equal schemas share a compiled grammar): a JSON object
    no deeper than MAX_SCHEMA_DEPTH."""
    _text(text, where)
    if _nesting(text) > MAX_SCHEMA_DEPTH:
        raise InvalidArgumentError(f"{where}: nested deeper than {MAX_SCHEMA_DEPTH} levels", field=where)
    try:
        schema = json.loads(text)
    except ValueError as error:
        raise InvalidArgumentError(f"{where}: not JSON ({error})", field=where) from None
    return canonical_schema(schema, where)


def canonical_schema(schema: Any, where: str) -> str:
    """A parsed schema as the JSON text compiled and cached: compact, its keys in the order given
    (the order of `properties` is the order of the answer's keys)."""
    if not isinstance(schema, dict | bool):
        raise InvalidArgumentError(f"{where}: a schema is a JSON object, got {type(schema).__name__}", field=where)
    return json.dumps(schema, separators=(",", ":"))


def _nesting(text: str) -> int:
    """The deepest bracket nesting of JSON text, strings skipped (counted without parsing, so
    a hostile body cannot recurse the parser)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest
