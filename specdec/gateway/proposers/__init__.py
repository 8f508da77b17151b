"""Drafting without a draft model: lookups in text the gateway has already seen."""

from specdec.gateway.proposers.draft import LookupDraft, match_class
from specdec.gateway.proposers.proposer import DEFAULT_LOOKUP, LookupProposer, LookupSettings

__all__ = ["DEFAULT_LOOKUP", "LookupDraft", "LookupProposer", "LookupSettings", "match_class"]
