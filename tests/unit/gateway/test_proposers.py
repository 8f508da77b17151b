"""Lookup proposers: prompt lookup in a request's own text and the cross-request suffix cache."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from specdec.errors import InvalidArgumentError
from specdec.gateway.draft_sources import DraftSource
from specdec.gateway.proposers import LookupDraft, LookupProposer, LookupSettings
from specdec.gateway.proposers.suffix_cache import SuffixCache
from specdec.prompt_lookup import LookupMatch, PromptLookupIndex, copy_forward, match_length


def lookup(tokens: list[int], k: int, min_n: int = 1, max_n: int = 3, **options: int) -> LookupDraft | None:
    index = PromptLookupIndex(min_n, max_n, **options)
    index.update(tokens)
    match = index.propose(tokens, k)
    return None if match is None else LookupDraft(match.tokens, DraftSource.PROMPT_LOOKUP, match.match_len)


def test_prompt_lookup_takes_the_longest_match() -> None:
    # "9 2" occurs once (followed by 3); "2" alone occurs later too (followed by 8).
    tokens = [9, 2, 3, 4, 5, 2, 8, 6, 9, 2]
    draft = lookup(tokens, k=3)
    assert draft == LookupDraft((3, 4, 5), DraftSource.PROMPT_LOOKUP, match_len=2)


def test_prompt_lookup_copies_from_the_occurrence_with_the_longest_real_match() -> None:
    # With 1-grams only, "2" occurs twice: the later one (followed by 8) matches 1 token,
    # the earlier one ("9 2", followed by 3) 2 tokens when measured backward.
    tokens = [9, 2, 3, 4, 5, 2, 8, 6, 9, 2]
    assert lookup(tokens, k=3, max_n=1) == LookupDraft((3, 4, 5), DraftSource.PROMPT_LOOKUP, match_len=2)
    # Table rows: every row opens with "| 0", the latest row is not the one being copied.
    row_a, row_b = [7, 0, 11, 12, 13], [7, 0, 21, 22, 23]
    tokens = [5, 6, *row_a, 8, *row_b, 8, 5, 6, 7, 0]
    assert lookup(tokens, k=3, max_n=2) == LookupDraft((11, 12, 13), DraftSource.PROMPT_LOOKUP, match_len=4)


def test_the_real_match_length_goes_past_the_longest_n_gram_up_to_its_cap() -> None:
    tokens = [*range(10, 20), 99, *range(10, 20)]
    assert lookup(tokens, k=1, max_n=3) == LookupDraft((99,), DraftSource.PROMPT_LOOKUP, match_len=10)
    assert lookup(tokens, k=1, max_n=3, max_match_len=6) == LookupDraft((99,), DraftSource.PROMPT_LOOKUP, 6)


def test_equal_real_matches_go_to_the_most_recent_and_only_recent_candidates_are_measured() -> None:
    tokens = [1, 2, 30, 1, 2, 40, 1, 2]
    assert lookup(tokens, k=1, max_n=2) == LookupDraft((40,), DraftSource.PROMPT_LOOKUP, match_len=2)
    # The best occurrence ("8 1 2") is the oldest of three: measured with 3 candidates, not with 2.
    tokens = [8, 1, 2, 30, 1, 2, 40, 1, 2, 50, 8, 1, 2]
    assert lookup(tokens, k=1, max_n=2, candidates=3).tokens == (30,)
    assert lookup(tokens, k=1, max_n=2, candidates=2).tokens == (50,)


def test_match_length_agrees_with_counting_token_by_token() -> None:
    rng = random.Random(3)
    for _ in range(300):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(2, 40))]
        end, limit = rng.randrange(1, len(tokens)), rng.randrange(1, 50)
        counted = 0
        while counted < min(limit, end) and tokens[end - 1 - counted] == tokens[-1 - counted]:
            counted += 1
        known = rng.randrange(0, counted + 1)
        assert match_length(tokens, end, known, limit) == counted


def test_prompt_lookup_prefers_the_most_recent_occurrence() -> None:
    tokens = [1, 2, 3, 0, 1, 2, 4, 0, 1, 2]
    assert lookup(tokens, k=2, max_n=2).tokens == (4, 0)


def test_prompt_lookup_never_matches_the_suffix_with_itself() -> None:
    assert lookup([5, 6, 7], k=4) is None
    assert lookup([1, 2, 3], k=4, min_n=2) is None
    assert lookup([1, 2, 1], k=4, min_n=2) is None


def test_a_repeating_text_repeats_on_past_the_end() -> None:
    # The latest "a b" is followed by one token; the proposal copies on from what it copied.
    assert lookup([7, 1, 2, 1, 2], k=5, max_n=2).tokens == (1, 2, 1, 2, 1)
    assert copy_forward([4, 4, 4], 2, 3) == (4, 4, 4)


def test_the_index_grows_with_the_tokens() -> None:
    index = PromptLookupIndex(1, 2)
    tokens = [1, 2, 3]
    index.update(tokens)
    assert index.propose(tokens, 2) is None
    tokens += [1, 2]
    index.update(tokens)
    assert index.propose(tokens, 2) == LookupMatch((3, 1), match_len=2, start=2)


def test_suffix_cache_proposes_the_most_frequent_continuation() -> None:
    cache = SuffixCache(capacity=100, min_n=1, max_n=3)
    for output in ([10, 11, 12, 13], [10, 11, 12, 13], [10, 11, 20, 21]):
        cache.add([1, 2], output)
    draft = cache.propose([5, 10, 11], k=4)
    assert draft is not None and draft.tokens == (12, 13)  # after 13 nothing was seen
    assert draft.score == (2, pytest.approx(2 / 3))
    assert cache.propose([2], k=3) == LookupDraft((10, 11, 12), DraftSource.SUFFIX, 1, 1.0)  # from the prompt's end


def test_suffix_cache_stops_where_no_continuation_dominates() -> None:
    cache = SuffixCache(capacity=100, min_n=1, max_n=2)
    for tail in (30, 31, 32):
        cache.add([], [7, 8, tail])
    draft = cache.propose([7], k=4)
    assert draft is not None and draft.tokens == (8,)  # 8 → 30 | 31 | 32: a third each
    assert cache.propose([8], k=2) is None


def test_suffix_cache_evicts_the_oldest_tokens() -> None:
    cache = SuffixCache(capacity=6, min_n=1, max_n=2)
    cache.add([], [1, 2, 3, 4])  # records 2, 3, 4 (the first token has no context)
    cache.add([], [5, 6, 7, 8])
    cache.add([], [9, 9, 9, 9])
    assert len(cache) == 6
    assert cache.propose([1], k=2) is None and cache.propose([5], k=3) is not None
    assert all(table for table in cache._tables)  # counts were taken back, not left at zero
    assert cache.propose([6], k=1) == LookupDraft((7,), DraftSource.SUFFIX, 1, 1.0)


def test_proposer_keeps_the_better_score() -> None:
    proposer = LookupProposer(LookupSettings(min_n=1, max_n=3, suffix_cache_tokens=100))
    proposer.finish("old", [0], [40, 41, 42, 43])
    # Its own text matches "42" (1 token); the suffix cache matches "41 42" (2 tokens).
    own = [42, 99, 41, 42]
    assert proposer.propose("a", own, 3) == LookupDraft((43,), DraftSource.SUFFIX, 2, 1.0)
    # A tie in match length goes to the request's own text.
    assert proposer.propose("b", [41, 42, 7, 41, 42], 1) == LookupDraft((7,), DraftSource.PROMPT_LOOKUP, 2)
    assert proposer.propose("b", [41, 42, 7, 41, 42], 0) is None
    proposer.forget("b")


def test_a_proposal_ends_at_its_first_stop_token() -> None:
    """A chat prompt ends every turn with EOS: a lookup copying a turn's end proposes nothing after it."""
    proposer = LookupProposer(LookupSettings(min_n=1, max_n=3, suffix_cache_tokens=0))
    text = [5, 6, 7, 2, 8, 9, 5, 6]
    whole = LookupDraft((7, 2, 8, 9), DraftSource.PROMPT_LOOKUP, 2)
    assert proposer.propose("a", text, 4) == whole
    assert proposer.propose("a", text, 4, stop_token_ids=(2, 0)) == whole.truncated(2)
    assert proposer.propose("a", text, 4, stop_token_ids=(9,)) == whole


def test_settings_are_validated() -> None:
    with pytest.raises(InvalidArgumentError, match="n-gram"):
        LookupSettings(min_n=3, max_n=2)
    with pytest.raises(InvalidArgumentError, match="suffix_cache_tokens"):
        LookupSettings(suffix_cache_tokens=-1)
    with pytest.raises(InvalidArgumentError, match="max_match_len"):
        LookupSettings(max_n=4, max_match_len=3)


def test_suffix_cache_counts_match_a_recount_after_evictions() -> None:
    rng = random.Random(5)
    cache = SuffixCache(capacity=50, min_n=1, max_n=2)
    outputs = [[rng.randrange(4) for _ in range(rng.randrange(2, 12))] for _ in range(30)]
    for output in outputs:
        cache.add([], output)
    recorded = list(cache._recorded)
    for table in cache._tables:
        for context, seen in table.items():
            recount = Counter(token for longest, token in recorded if longest[-len(context):] == context
                              and len(longest) >= len(context))
            assert seen.counts == dict(recount) and seen.total == sum(recount.values())
            token, share = seen.best()
            assert recount[token] == max(recount.values()) and share == recount[token] / seen.total
