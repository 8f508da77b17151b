"""Grammars compiled once per tokenizer: llguidance matchers kept as templates (bounded in
number and in grammar bytes, least recently used dropped first), each request walking its own
copy."""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Sequence

import llguidance
import llguidance.hf
from transformers import PreTrainedTokenizerBase

from specdec.errors import InvalidArgumentError
from specdec.grammar.state import RequestGrammar

log = logging.getLogger(__name__)

#: Compiled grammars kept: at most this many, and at most this many bytes of grammar text. A
#: template's memory grows with its grammar (its lexer and tables are built lazily as requests
#: walk it), so the text's size bounds it where a count alone would let 256 large schemas pile up.
CACHE_ENTRIES = 256
CACHE_BYTES = 16 * 1024 * 1024
#: llguidance's bounds on one grammar's size and on the lexer work per token: a hostile grammar
#: is refused, or fails its request, instead of stalling the thread that masks every request.
def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(max_grammar_size=500_000, step_lexer_fuel=200_000,
                                     initial_lexer_fuel=1_000_000)


class GrammarCompiler:
    """Compiles llguidance grammar texts for one tokenizer whose logits are `vocab_size` wide and
    whose requests end at `eos_token_ids`. Thread-safe; compiling runs on the caller's thread (the
    gateway's tokenizer thread, the draft's executor: off any event loop)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Sequence[int],
                 max_entries: int = CACHE_ENTRIES, max_bytes: int = CACHE_BYTES) -> None:
        self.hf_tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._templates: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
        self._bytes = 0  # the cached grammars' text
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """The vocabulary as llguidance reads it, built on first use (about a second for 50k
        tokens, several for 128k; `warm` builds it at start-up) and shared by the process's
        gateways with the same tokenizer."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = _grammar_tokenizer(self.hf_tokenizer, self.vocab_size, tuple(self.eos_token_ids))
            return self._tokenizer

    def warm(self) -> None:
        self.tokenizer  # noqa: B018 - builds it

    def compile(self, text: str, field: str) -> RequestGrammar:
        """A fresh walk through the grammar `text` (llguidance's grammar format); INVALID_ARGUMENT
        naming `field` when llguidance refuses it (bad syntax, an unsupported schema feature, a limit)."""
        template = self._template(text, field)
        return RequestGrammar(template.deep_copy(), text, self.vocab_size, self.eos_token_ids)

    def _template(self, text: str, field: str) -> llguidance.LLMatcher:
        with self._lock:
            template = self._templates.get(text)
            if template is not None:
                self._templates.move_to_end(text)
                return template
        tokenizer = self.tokenizer
        limits = _limits()
        error = llguidance.LLMatcher.validate_grammar(text, tokenizer, limits=limits)
        if error:
            raise InvalidArgumentError(f"{field}: {_first_lines(error)}", field=field)
        template = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=limits)
        if template.is_error():
            raise InvalidArgumentError(f"{field}: {_first_lines(template.get_error())}", field=field)
        with self._lock:
            if text not in self._templates:
                self._templates[text] = template
                self._bytes += len(text)
            while len(self._templates) > max(1, self.max_entries) or (len(self._templates) > 1
                                                                      and self._bytes > self.max_bytes):
                dropped, _ = self._templates.popitem(last=False)
                self._bytes -= len(dropped)
        return template

    def cached(self) -> tuple[int, int]:
        """Grammars cached, and the bytes of their text."""
        with self._lock:
            return len(self._templates), self._bytes


@functools.lru_cache(maxsize=4)
def _grammar_tokenizer(tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                       eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    started = time.perf_counter()
    # A tokenizer may hold more ids than the model has logits (Llama 3.2: one more); llguidance
    # wants them all, and a request's masks are cut to the logits' width.
    n_vocab = max(vocab_size, len(tokenizer))
    built = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab,  # type: ignore[arg-type]
                                         eos_token=list(eos_token_ids))
    log.info("grammar tokenizer ready in %.1f s (%d tokens)", time.perf_counter() - started, n_vocab)
    return built


def _first_lines(error: str, limit: int = 400) -> str:
    text = " ".join(line.strip() for line in error.strip().splitlines() if line.strip())
    return text if len(text) <= limit else text[: limit - 1] + "…"
