"""The structured workload's prompts and schemas, and the check every constrained answer must pass.

Three kinds of answer (`SchemaKind`), four prompts each: extraction to a schema of strings,
integers, an enum and a boolean; a tool call (the tool's name as a constant, its arguments an
object of its own); an enum-heavy ticket triage. Strings carry `maxLength` so that an answer
fits the scenario's token budget. The schemas use a small subset of JSON Schema, and
`schema_problems` checks exactly that subset (the harness declares no JSON Schema dependency).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

Schema = Mapping[str, Any]


class SchemaKind(Enum):
    EXTRACTION = "extraction"
    TOOL_CALL = "tool call"
    CLASSIFICATION = "classification"


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    """An object with exactly these properties, all required, in this order."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _text(max_length: int) -> dict[str, Any]:
    return {"type": "string", "minLength": 1, "maxLength": max_length}


PERSON = _object({
    "name": _text(24), "age": {"type": "integer", "minimum": 0, "maximum": 120}, "city": _text(24),
    "occupation": {"enum": ["engineer", "teacher", "doctor", "nurse", "artist", "farmer", "lawyer", "chef"]},
    "employed": {"type": "boolean"},
})


def _tool(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return _object({"name": {"const": name}, "arguments": _object(arguments)})


WEATHER = _tool("get_weather", {"location": _text(24), "unit": {"enum": ["celsius", "fahrenheit"]},
                                "days": {"type": "integer", "minimum": 1, "maximum": 14}})
BOOKING = _tool("book_table", {"restaurant": _text(24), "party_size": {"type": "integer", "minimum": 1, "maximum": 20},
                               "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}})
CURRENCY = ("USD", "EUR", "GBP", "JPY", "CHF")
CONVERSION = _tool("convert_currency", {"amount": {"type": "number", "minimum": 0}, "from": {"enum": list(CURRENCY)},
                                        "to": {"enum": list(CURRENCY)}})
TRIAGE = _object({
    "category": {"enum": ["billing", "shipping", "technical", "account", "other"]},
    "priority": {"enum": ["low", "medium", "high", "urgent"]},
    "sentiment": {"enum": ["positive", "negative", "neutral"]},
    "language": {"enum": ["english", "spanish", "german", "french"]},
    "needs_human": {"type": "boolean"},
    "product_area": {"enum": ["mobile app", "website", "hardware", "subscription"]},
})


@dataclass(frozen=True)
class StructuredPrompt:
    kind: SchemaKind
    text: str
    schema: Schema


def _extract(text: str) -> StructuredPrompt:
    return StructuredPrompt(SchemaKind.EXTRACTION, f"Extract the person described below as JSON.\n\n{text}", PERSON)


def _call(text: str, schema: Schema) -> StructuredPrompt:
    return StructuredPrompt(SchemaKind.TOOL_CALL, f"Answer with a call to the right tool, as JSON.\n\n{text}", schema)


def _triage(text: str) -> StructuredPrompt:
    return StructuredPrompt(SchemaKind.CLASSIFICATION, f"Classify this support ticket as JSON.\n\n{text}", TRIAGE)


STRUCTURED_PROMPTS: tuple[StructuredPrompt, ...] = (
    _extract("Maria Lopez, 34, teaches history at a secondary school in Madrid."),
    _extract("Tom Becker is a 51 year old doctor living in Berlin; he retired last spring."),
    _extract("Our new chef, Aiko Tanaka (28), moved from Osaka to Lyon to run the kitchen."),
    _extract("Farmer Joe Miller, aged 67, still works his fields outside Des Moines every day."),
    _call("What's the weather going to be in Paris for the next three days? Use celsius.", WEATHER),
    _call("Book a table for 4 at Luigi's Trattoria at 19:30, please.", BOOKING),
    _call("How much is 250 US dollars in euros?", CONVERSION),
    _call("Is it going to rain in Boston this week? I only understand fahrenheit.", WEATHER),
    _triage("I was charged twice for my subscription this month and nobody answers my emails. Fix it now!"),
    _triage("Hola, la aplicación se cierra cada vez que intento subir una foto."),
    _triage("Just wanted to say the new website is lovely, ordering was quick and easy. Thanks!"),
    _triage("My parcel was supposed to arrive last Tuesday and the tracking page hasn't changed since."),
)


def schema_problems(value: Any, schema: Schema, where: str = "$") -> list[str]:
    """Where `value` (parsed JSON) breaks `schema`, for the subset the workload uses: type
    (object, string, integer, number, boolean), properties, required, additionalProperties
    false, enum, const, minLength / maxLength, pattern (anchored), minimum / maximum."""
    problems: list[str] = []
    if "const" in schema and value != schema["const"]:
        problems.append(f"{where}: {value!r} is not {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{where}: {value!r} is not one of {schema['enum']}")
    kind = schema.get("type")
    if kind is not None and not _is_type(value, kind):
        return problems + [f"{where}: {type(value).__name__} is not {kind}"]
    if isinstance(value, str):
        problems += _string_problems(value, schema, where)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            problems.append(f"{where}: {value} < {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            problems.append(f"{where}: {value} > {schema['maximum']}")
    elif isinstance(value, dict):
        problems += _object_problems(value, schema, where)
    return problems


def _is_type(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    types = {"object": dict, "string": str, "boolean": bool, "array": list, "null": type(None)}
    if kind not in types:
        raise ValueError(f"the checker does not know type {kind!r}")
    return isinstance(value, types[kind])


def _string_problems(value: str, schema: Schema, where: str) -> list[str]:
    problems = []
    if len(value) < schema.get("minLength", 0):
        problems.append(f"{where}: shorter than {schema['minLength']} characters")
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        problems.append(f"{where}: longer than {schema['maxLength']} characters")
    if "pattern" in schema and re.search(schema["pattern"], value) is None:
        problems.append(f"{where}: {value!r} does not match {schema['pattern']}")
    return problems


def _object_problems(value: dict[str, Any], schema: Schema, where: str) -> list[str]:
    properties: Mapping[str, Schema] = schema.get("properties", {})
    problems = [f"{where}: {name!r} is missing" for name in schema.get("required", ()) if name not in value]
    if schema.get("additionalProperties", True) is False:
        problems += [f"{where}: {name!r} is not allowed" for name in value if name not in properties]
    for name, sub in properties.items():
        if name in value:
            problems += schema_problems(value[name], sub, f"{where}.{name}")
    return problems


def answer_problem(text: str, finish_reason: str, schema: Schema) -> str:
    """Why a constrained answer fails ("" when it parses, satisfies `schema` and ended by stop)."""
    if finish_reason != "stop":
        return f"finished by {finish_reason}, not stop"
    try:
        value = json.loads(text)
    except ValueError as error:
        return f"not JSON ({error}): {text[:80]!r}"
    return "; ".join(schema_problems(value, schema))


def prompt_texts(prompts: Sequence[StructuredPrompt] = STRUCTURED_PROMPTS) -> tuple[str, ...]:
    return tuple(p.text for p in prompts)
