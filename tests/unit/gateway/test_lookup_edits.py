"""Learned edits: the rules an answer's changes to what it copies teach prompt lookup."""

from __future__ import annotations

import pytest

from specdec.errors import InvalidArgumentError
from specdec.gateway.proposers import LookupProposer, LookupSettings
from specdec.gateway.proposers.edits import REJOIN, EditTracker, apply_rules, edit_rule, rejoin_point
from specdec.prompt_lookup import LookupMatch, PromptLookupIndex

OLD, NEW_A, NEW_B = 50, 60, 61
#: A function whose variable OLD the answer renames to the two tokens NEW_A NEW_B.
SOURCE = [1, 2, 3, 4, OLD, 5, 6, 7, 8, 9, 10, OLD, 11, 12, 13, 14, 15, 16, 17, OLD, 18, 19, 20, 21]
PROMPT = [90, 91, 92, *SOURCE, 93, 94]
ANSWER = [t for token in SOURCE for t in ((NEW_A, NEW_B) if token == OLD else (token,))]


def decode(proposer: LookupProposer, prompt: list[int], answer: list[int], k: int) -> list[tuple[int, tuple[int, ...]]]:
    """Greedy lookup-only decoding of `answer`: each round keeps the proposal's prefix that
    equals the answer and one token of the target's. Returns (tokens done, proposal) a round."""
    rounds, done = [], 0
    while done < len(answer):
        draft = proposer.propose("r", prompt + answer[:done], k)
        proposal = () if draft is None else draft.tokens
        rounds.append((done, proposal))
        kept = next((i for i, (a, b) in enumerate(zip(proposal, answer[done:])) if a != b), len(proposal))
        done += min(kept + 1, len(answer) - done)
    return rounds


def proposer(max_edits: int) -> LookupProposer:
    return LookupProposer(LookupSettings(suffix_cache_tokens=0, max_edits=max_edits))


def test_a_rename_is_learned_and_proposed_where_the_copy_meets_the_old_token_again() -> None:
    plain = decode(proposer(0), PROMPT, ANSWER, k=16)
    edited = decode(proposer(16), PROMPT, ANSWER, k=16)
    assert len(edited) < len(plain)
    last_rename = len(ANSWER) - 6  # NEW_A NEW_B 18 19 20 21

    def proposes_the_last_rename(rounds: list[tuple[int, tuple[int, ...]]]) -> bool:
        return any(done < last_rename and proposal[last_rename - done : last_rename - done + 2] == (NEW_A, NEW_B)
                   for done, proposal in rounds)

    # Once learned, a proposal running into the third OLD proposes the new name instead.
    assert proposes_the_last_rename(edited) and not proposes_the_last_rename(plain)


def test_with_edits_off_the_proposals_are_the_plain_index_s() -> None:
    lookup, done = proposer(0), 0
    while done < len(ANSWER):
        text = PROMPT + ANSWER[:done]
        index = PromptLookupIndex()
        index.update(text)
        match, draft = index.propose(text, 8), lookup.propose("r", text, 8)
        assert (draft and draft.tokens) == (match and match.tokens)
        done += 1
    assert LookupSettings().max_edits > 0  # on by default


def test_the_tracker_learns_the_rule_when_the_text_rejoins_its_copy() -> None:
    tracker = EditTracker(max_edit=4, max_rules=16)
    text = [*PROMPT, 1, 2]  # the answer is copying SOURCE
    tracker.follow(LookupMatch((3, 4), match_len=2, start=5), at=len(text))
    text += [3, 4, NEW_A]
    assert not tracker.observe(text)  # left the copy (held for 2 + 2 tokens), not yet back
    text += [NEW_B, 5]
    assert not tracker.observe(text)  # one token agrees again: REJOIN needs two
    text += [6]
    assert tracker.observe(text)
    assert tracker.rules == {(OLD,): (NEW_A, NEW_B)}
    assert tracker.first_edit_at == len(PROMPT) + 4


def test_a_copy_that_ends_teaches_nothing_and_short_matches_are_not_followed() -> None:
    tracker = EditTracker(max_edit=2, max_rules=16)
    text = [*PROMPT, 1, 2, 3, 4]
    tracker.follow(LookupMatch((OLD,), match_len=4, start=7), at=len(text))
    for token in (70, 71, 72, 73, 74, 75):  # never rejoins
        text.append(token)
        assert not tracker.observe(text)
    assert tracker.rules == {}
    # A one-token coincidence that held for one more token: too short a copy to learn from.
    text += [1]
    tracker.follow(LookupMatch((2, 3), match_len=1, start=4), at=len(text))
    text += [2, NEW_A, 3, 4]
    assert not tracker.observe(text)
    assert tracker.rules == {}


def test_rejoin_point_finds_the_smallest_edit() -> None:
    #            source: 0  1  2  3  4       at: 5
    tokens = [1, 2, 3, 4, 5, 9, 3, 4]
    assert rejoin_point(tokens, source=1, at=5, max_edit=4) == (1, 1)  # 2 → 9, then "3 4" again
    assert rejoin_point([1, 2, 3, 4, 5, 3, 4], source=1, at=5, max_edit=4) == (0, 1)  # 2 deleted
    assert rejoin_point([1, 2, 3, 4, 5, 9, 2, 3], source=1, at=5, max_edit=4) == (1, 0)  # 9 inserted
    assert rejoin_point([1, 2, 3, 4, 5, 9, 3], source=1, at=5, max_edit=4) is None  # not enough tokens yet
    assert rejoin_point([1, 2, 3, 4, 5, 9, 9, 3, 4], source=1, at=5, max_edit=1) is None  # edit too long
    assert REJOIN == 2


def test_rules_replace_delete_and_insert() -> None:
    tokens = [1, 2, 3, 4, 5, 9, 3, 4]
    assert edit_rule(tokens, source=1, at=5, new=1, old=1) == ((2,), (9,))
    assert edit_rule(tokens, source=1, at=5, new=0, old=1) == ((2,), ())
    assert edit_rule(tokens, source=1, at=5, new=1, old=0) == ((1,), (1, 9))  # keyed by the token before
    assert edit_rule(tokens, source=0, at=5, new=1, old=0) is None  # nothing before the insertion


def test_apply_rules_prefers_the_longest_old_tokens() -> None:
    rules = {(1,): (7,), (1, 2): (8, 8), (3,): ()}
    assert apply_rules([1, 2, 1, 3, 4, 1], rules) == [8, 8, 7, 4, 7]


def test_rules_are_capped_per_request() -> None:
    tracker = EditTracker(max_edit=4, max_rules=1)
    base = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0]
    text = [*base, 1]
    tracker.follow(LookupMatch((2, 3, 4, 5), match_len=1, start=1), at=len(text))
    assert tracker.observe([*text, 2, 3, 4, 70, 6, 7])  # 5 → 70
    text = [*base, 5, 6, 7]
    tracker.follow(LookupMatch((8, 9), match_len=3, start=7), at=len(text))
    assert not tracker.observe([*text, 8, 71, 10, 11])  # 9 → 71: one rule too many
    assert tracker.rules == {(5,): (70,)}


def test_settings_are_checked_and_state_goes_with_the_request() -> None:
    with pytest.raises(InvalidArgumentError, match="max_edits"):
        LookupSettings(max_edits=-1)
    with pytest.raises(InvalidArgumentError, match="max_edit_tokens"):
        LookupSettings(max_edit_tokens=0)
    lookup = proposer(16)
    decode(lookup, PROMPT, ANSWER, k=8)
    assert lookup._edited
    lookup.forget("r")
    assert not lookup._edited and not lookup._indexes


def test_a_rule_the_text_breaks_by_copying_the_old_tokens_goes() -> None:
    tracker = EditTracker(max_edit=4, max_rules=16)
    tracker.rules = {(OLD,): (NEW_A, NEW_B), (4,): (4, 70)}  # rename OLD; insert 70 after every 4
    tracker.first_edit_at = len(PROMPT)
    text = [*PROMPT, 1]
    tracker.follow(LookupMatch((2, 3, 4), match_len=1, start=4), at=len(text))
    text += [2, 3, 4]  # the copy stopped right after 4: the insertion may still come
    assert not tracker.observe(text)
    assert set(tracker.rules) == {(OLD,), (4,)}
    tracker.follow(LookupMatch((OLD, 5), match_len=4, start=7), at=len(text))
    text += [OLD, 5, 6]  # OLD copied as it was, and 4 had no 70 after it before
    assert tracker.observe(text)
    assert set(tracker.rules) == {(4,)}
    tracker.follow(LookupMatch((7,), match_len=3, start=10), at=len(text))
    text += [7, 8]
    assert not tracker.observe(text)  # nothing of a rule in what was copied
    # A copy of the answer's own "4 70" (text the rule made) keeps the rule.
    text += [4, 70, 9]
    tracker.follow(LookupMatch((4, 70, 9), match_len=1, start=len(text) - 3), at=len(text))
    assert not tracker.observe([*text, 4, 70, 9])
    assert set(tracker.rules) == {(4,)}
    text_copying_4 = [*text, 1]
    tracker.follow(LookupMatch((2, 3, 4, OLD), match_len=1, start=4), at=len(text_copying_4))
    assert tracker.observe([*text_copying_4, 2, 3, 4, OLD])  # 4 then OLD, not 4 then 70
    assert tracker.rules == {}


def test_a_rule_broken_where_the_copy_parts_is_reported_as_a_change() -> None:
    # The edited lookup rebuilds its index only when observe says the rules changed.
    tracker = EditTracker(max_edit=4, max_rules=16)
    tracker.rules, tracker.first_edit_at = {(OLD,): (NEW_A, NEW_B)}, len(PROMPT)
    text = [*PROMPT, 1]
    tracker.follow(LookupMatch((2, 3, 4, OLD, 5), match_len=4, start=PROMPT.index(2)), at=len(text))
    assert tracker.observe([*text, 2, 3, 4, OLD, 99])  # OLD copied as it was, then the text parts
    assert tracker.rules == {}
