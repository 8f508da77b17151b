"""Grammars over a tokenizer's vocabulary (llguidance): compiled once per grammar text
(`compiler`) and walked token by token per request (`state`). The gateway walks a request's
grammar to mask the target's rows; the draft walks its own copy to mask its q."""

from specdec.grammar.compiler import GrammarCompiler
from specdec.grammar.state import RequestGrammar

__all__ = ["GrammarCompiler", "RequestGrammar"]
