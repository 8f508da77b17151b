"""Drafting without a draft model: lookups in text the gateway has already seen."""

from specdec.gateway.proposers.draft import LookupDraft, match_class
from specdec.gateway.proposers.proposer import LookupProposer, LookupSettings

__all__ = ["LookupDraft", "LookupProposer", "LookupSettings", "match_class"]
