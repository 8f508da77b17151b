"""The gateway's lookup proposer: prompt lookup per request, one suffix cache for all of them.

The gateway holds every request's tokens, so a lookup needs no call to another service. Each
round the scheduler asks for a proposal per request that allows lookups; the K planner decides
whether to verify it (`specdec.gateway.planner`). Of a request's two candidate proposals the
one with the better score (longer match, then higher frequency) wins, the request's own text on a tie.
The request's own text is looked up as written and with the edits its answer has made to
what it copies (`proposers.edits`), the edited lookup winning where it matches as long.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from specdec.errors import InvalidArgumentError
from specdec.gateway.draft_sources import DraftSource
from specdec.gateway.proposers.draft import LookupDraft
from specdec.gateway.proposers.edits import EditedLookup
from specdec.gateway.proposers.suffix_cache import MIN_SHARE, SuffixCache
from specdec.prompt_lookup import CANDIDATES, MAX_MATCH_LEN, MAX_N, MIN_N, PromptLookupIndex


@dataclass(frozen=True)
class LookupSettings:
    """n-gram lengths matched, and the suffix cache's size (0 turns it off). Its defaults are the
    gateway's flags' (`DEFAULT_LOOKUP`)."""

    min_n: int = MIN_N
    max_n: int = MAX_N
    suffix_cache_tokens: int = 65536
    #: A suffix proposal goes on while its next token holds this share of its context's counts.
    suffix_min_share: float = MIN_SHARE
    #: Prompt lookup measures this many recent occurrences of the matched n-gram backward ...
    candidates: int = CANDIDATES
    #: ... up to this many tokens, and copies from the one with the longest real match.
    max_match_len: int = MAX_MATCH_LEN
    #: Learn the edits an answer makes to what it copies (`proposers.edits`): at most this many
    #: rules a request (0 = off), each replacing at most `max_edit_tokens` tokens by as many.
    max_edits: int = 16
    max_edit_tokens: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise InvalidArgumentError(f"n-gram lengths must satisfy 1 <= min <= max, got {self.min_n}..{self.max_n}")
        if self.suffix_cache_tokens < 0:
            raise InvalidArgumentError(f"suffix_cache_tokens must be >= 0, got {self.suffix_cache_tokens}",
                                       field="suffix_cache_tokens")
        if self.candidates < 1 or self.max_match_len < self.max_n:
            raise InvalidArgumentError(f"lookup candidates must be >= 1 and max_match_len >= max_n, got "
                                       f"{self.candidates} and {self.max_match_len}")
        if self.max_edits < 0 or self.max_edit_tokens < 1:
            raise InvalidArgumentError(f"max_edits must be >= 0 and max_edit_tokens >= 1, got {self.max_edits} and "
                                       f"{self.max_edit_tokens}", field="max_edits")
        if not 0.0 < self.suffix_min_share <= 1.0:
            raise InvalidArgumentError(f"suffix_min_share must lie in (0, 1], got {self.suffix_min_share}",
                                       field="suffix_min_share")


#: The lookups of a gateway that sets nothing: its flags' defaults.
DEFAULT_LOOKUP = LookupSettings()


class LookupProposer:
    """Proposals from the requests' own text and from recent outputs; state per slot id."""

    def __init__(self, settings: LookupSettings) -> None:
        self.settings = settings
        self.suffixes = SuffixCache(settings.suffix_cache_tokens, settings.min_n, settings.max_n,
                                    settings.suffix_min_share)
        self._indexes: dict[str, PromptLookupIndex] = {}
        self._edited: dict[str, EditedLookup] = {}

    def propose(
        self, slot_id: str, tokens: list[int], k: int, stop_token_ids: Collection[int] = ()
    ) -> LookupDraft | None:
        """The better of the prompt-lookup and the suffix proposal of up to `k` tokens for the
        request holding `tokens` (its prompt and output so far), or None; cut after the first of
        `stop_token_ids` it holds (the tokens that end the request: a chat prompt holds them
        at the end of every turn)."""
        if k <= 0:
            return None
        index = self._indexes.get(slot_id)
        if index is None:
            index = self._indexes[slot_id] = self._new_index()
        index.update(tokens)
        match = index.propose(tokens, k)
        edited = self._edited_lookup(slot_id).propose(tokens, match, k) if self.settings.max_edits else None
        if edited is not None and (match is None or edited.match_len >= match.match_len):
            match = edited
        own = None if match is None else LookupDraft(match.tokens, DraftSource.PROMPT_LOOKUP, match.match_len)
        shared = self.suffixes.propose(tokens, k) if len(self.suffixes) else None
        best = shared if own is None or (shared is not None and shared.score > own.score) else own
        return None if best is None else best.through_stop(stop_token_ids)

    def _new_index(self) -> PromptLookupIndex:
        settings = self.settings
        return PromptLookupIndex(settings.min_n, settings.max_n, candidates=settings.candidates,
                                 max_match_len=settings.max_match_len)

    def _edited_lookup(self, slot_id: str) -> EditedLookup:
        edited = self._edited.get(slot_id)
        if edited is None:
            edited = self._edited[slot_id] = EditedLookup(self._new_index, self.settings.max_edit_tokens,
                                                          self.settings.max_edits)
        return edited

    def finish(self, slot_id: str, prompt: list[int], output: list[int]) -> None:
        """A request ended: its output joins the suffix cache, its index goes."""
        self.suffixes.add(prompt, output)
        self.forget(slot_id)

    def forget(self, slot_id: str) -> None:
        """Drop a request's index (it ended without an output worth keeping, or was preempted)."""
        self._indexes.pop(slot_id, None)
        self._edited.pop(slot_id, None)
