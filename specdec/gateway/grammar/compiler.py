"""Grammars compiled once, for the gateway's tokenizer: llguidance matchers kept as templates
(bounded, least recently used dropped first), each request walking its own copy."""

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
from specdec.gateway.grammar.spec import StructuredOutput
from specdec.gateway.grammar.state import RequestGrammar

log = logging.getLogger(__name__)

#: Compiled grammars kept: a template is small (its lexer and tables are built lazily as
#: requests walk it), and a service sees few distinct schemas at a time.
CACHE_ENTRIES = 256
#: llguidance's bounds on one grammar's size and on the lexer work per token: a hostile grammar
#: is refused, or fails its request, instead of stalling the thread that masks every request.
def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(max_grammar_size=500_000, step_lexer_fuel=200_000,
                                     initial_lexer_fuel=1_000_000)


class GrammarCompiler:
    """Compiles `StructuredOutput`s for one tokenizer whose logits are `vocab_size` wide and whose
    requests end at `eos_token_ids`. Thread-safe; compiling runs on the caller's thread (the
    gateway's tokenizer thread, off the event loop)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.hf_tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._templates: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
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

    def compile(self, output: StructuredOutput, field: str) -> RequestGrammar:
        """A fresh walk through `output`'s grammar; INVALID_ARGUMENT naming `field` when llguidance
        refuses it (bad syntax, an unsupported schema feature, a limit)."""
        try:
            text = output.grammar()
        except (ValueError, TypeError) as error:
            raise InvalidArgumentError(f"{field}: {error}", field=field) from None
        template = self._template(text, field)
        return RequestGrammar(template.deep_copy(), self.vocab_size, self.eos_token_ids)

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
            self._templates[text] = template
            while len(self._templates) > CACHE_ENTRIES:
                self._templates.popitem(last=False)
        return template

    def cached(self) -> int:
        return len(self._templates)


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
