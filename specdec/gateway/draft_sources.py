"""Where a round's draft tokens come from, and which sources a request allows.

A request's `SpeculationMethod` says which sources it may use; each round the K planner picks
one `DraftSource` per request (or none: plain decoding). The model draft costs a Propose and
K draft steps; a lookup costs nothing but the verified tokens; a lookup first and the model
continuing costs the draft steps the lookup did not save (docs/architecture.md#drafting-without-a-draft-model).
"""

from __future__ import annotations

import enum


class SpeculationMethod(enum.Enum):
    """What a request lets the gateway draft with (`SpeculationOptions.method`)."""

    #: The planner chooses per round among the model draft, a lookup and plain decoding.
    AUTO = "auto"
    #: The draft model only.
    MODEL = "model"
    #: Lookups only: prompt lookup and the cross-request suffix cache; no draft service needed.
    NGRAM = "ngram"
    #: Plain decoding.
    NONE = "none"

    @property
    def allows_model(self) -> bool:
        return self in (SpeculationMethod.AUTO, SpeculationMethod.MODEL)

    @property
    def allows_lookup(self) -> bool:
        return self in (SpeculationMethod.AUTO, SpeculationMethod.NGRAM)


class DraftSource(enum.Enum):
    """What proposed one request's draft tokens in one round; the value labels the metrics."""

    MODEL = "model"
    #: The request's own prompt and output (`specdec.prompt_lookup`).
    PROMPT_LOOKUP = "prompt_lookup"
    #: Recent outputs of all requests (`proposers.suffix_cache`).
    SUFFIX = "suffix"
    #: The draft model guided by lookups: it checks a lookup's guess (the gateway's,
    #: `ProposeItem.guess_tokens`, or its own, `lookup_guesses`) in one forward and drafts on by
    #: itself from the first token it would not draw.
    LOOKUP_THEN_MODEL = "lookup_then_model"
    #: A structured-output request's grammar: the tokens it allows alone from here (its keys,
    #: quotes, braces), accepted for certain, at no draft cost.
    GRAMMAR = "grammar"

    @property
    def is_lookup(self) -> bool:
        """A deterministic proposal alone gave the tokens (the draft model did not run)."""
        return self in (DraftSource.PROMPT_LOOKUP, DraftSource.SUFFIX, DraftSource.GRAMMAR)


#: Every source, in the order metrics list them.
DRAFT_SOURCES = tuple(DraftSource)
