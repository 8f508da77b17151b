"""Learned edits: prompt lookup through the changes a request's answer makes to what it copies.

Answers that transform their prompt (rename a variable or a key, reformat records, fix a
repeated misspelling) copy in runs and change the same tokens the same way each time. Plain
prompt lookup stumbles at every change: the copy it proposes still holds the old tokens, and
after the change its n-gram ends in new tokens the prompt lacks, so the request decodes
plainly until a match forms again.

`EditTracker` follows the copy each prompt-lookup proposal makes. When the text leaves that
copy and meets it again within `max_edit` tokens on both sides (`REJOIN` equal tokens in a
row), it has seen one edit: the source's tokens between the two points became the answer's.
An edit that replaced or deleted tokens becomes the rule `old → new`; one that only inserted
tokens becomes the rule `t → t + inserted` for the token t before the insertion. A rule goes
again when a later copy writes a rule's old tokens as they were (the edit was not a rule).

`EditedLookup` applies the rules to the request's text before its first edit (the answer
from there on already has the new form) and indexes that edited text as `PromptLookupIndex`
indexes the text itself. A lookup there matches through the changed tokens and proposes the
change wherever the copy reaches old tokens again. The proposer takes the edited lookup where
it matches at least as long as the plain one (`specdec.gateway.proposers.proposer`).
A rule that does not hold elsewhere only costs its proposals: the tokens are verified as any
lookup's are, so output is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

from specdec.prompt_lookup import LookupMatch, PromptLookupIndex, common_prefix_length

#: Equal tokens in a row after an edit that show the text is copying its source again.
REJOIN = 2
#: A copy teaches an edit where it held for at least this many tokens before the text left it
#: (its match and the tokens copied since): shorter ones are coincidences.
MIN_COPIED = 4

Rule = tuple[tuple[int, ...], tuple[int, ...]]


class EditTracker:
    """One request's learned rules (old tokens → new tokens), from the copies its lookups proposed."""

    def __init__(self, max_edit: int, max_rules: int) -> None:
        self.max_edit, self.max_rules = max_edit, max_rules
        self.rules: dict[tuple[int, ...], tuple[int, ...]] = {}
        #: Text index of the earliest learned edit's new tokens: the text before it has the old form.
        self.first_edit_at: int | None = None
        #: (source index, text index, match length): the last proposal copies text[source:] to text[at:].
        self._copy: tuple[int, int, int] | None = None
        #: (source index, text index) where the text left its copy; None while copying.
        self._parted: tuple[int, int] | None = None

    def follow(self, match: LookupMatch | None, at: int) -> None:
        """This round's prompt-lookup proposal (or None) for the text from index `at` on."""
        if self._parted is None:
            self._copy = None if match is None else (match.start, at, match.match_len)

    def observe(self, tokens: list[int]) -> bool:
        """Look at how the text went on since the last proposal; True when the rules changed."""
        dropped = False
        if self._parted is None and self._copy is not None:
            source, at, matched = self._copy
            kept = common_prefix_length(tokens[at:], tokens[source : source + len(tokens) - at])
            dropped = self._drop_contradicted(tokens, source, source + kept)
            if at + kept < len(tokens):
                self._copy = None
                if matched + kept >= MIN_COPIED:
                    self._parted = (source + kept, at + kept)
        if self._parted is None:
            return dropped
        source, at = self._parted
        rejoined = rejoin_point(tokens, source, at, self.max_edit)
        if rejoined is None:
            if len(tokens) - at > self.max_edit + REJOIN:  # the copy ended: the answer moved on
                self._parted = self._copy = None
            return dropped
        self._parted = self._copy = None
        return self._learn(edit_rule(tokens, source, at, *rejoined), at) or dropped

    def _drop_contradicted(self, tokens: list[int], start: int, end: int) -> bool:
        """Drop the rules that the text has just broken by copying tokens[start:end] as they
        were: where a rule's old tokens begin in that span and the copy wrote other tokens than
        the rule says. Only the text before the first edit has the old form: a copy of the
        answer since then copies tokens the rules already made. True when a rule went."""
        if self.first_edit_at is not None:
            end = min(end, self.first_edit_at)
        broken = []
        for old, new in self.rules.items():
            for i in range(start, end):
                if tokens[i] != old[0] or tuple(tokens[i : i + len(old)]) != old:
                    continue
                written = tokens[i:end]
                if written != [*new, *tokens[i + len(old) : end]][: len(written)]:
                    broken.append(old)
                    break
        for old in broken:
            del self.rules[old]
        return bool(broken)

    def _learn(self, rule: Rule | None, at: int) -> bool:
        if rule is None or self.rules.get(rule[0]) == rule[1]:
            return False
        if rule[0] not in self.rules and len(self.rules) >= self.max_rules:
            return False
        self.rules[rule[0]] = rule[1]
        self.first_edit_at = at if self.first_edit_at is None else min(self.first_edit_at, at)
        return True


def rejoin_point(tokens: list[int], source: int, at: int, max_edit: int) -> tuple[int, int] | None:
    """The smallest edit (new, old): `new` tokens written from text index `at` in place of
    `old` tokens of the source from index `source`, after which `REJOIN` tokens agree again;
    None if there is none of at most `max_edit` tokens a side (yet). The source lies before
    the text it was copied to."""
    best: tuple[int, int] | None = None
    for new in range(max_edit + 1):
        if at + new + REJOIN > len(tokens):
            break
        again = tokens[at + new : at + new + REJOIN]
        for old in range(max_edit + 1):
            if source + old + REJOIN > at:
                break
            if (new or old) and tokens[source + old : source + old + REJOIN] == again:
                if best is None or new + old < sum(best):
                    best = (new, old)
                break
    return best


def edit_rule(tokens: list[int], source: int, at: int, new: int, old: int) -> Rule | None:
    """The rule of an edit found by `rejoin_point`; an insertion is keyed by the token before it."""
    written = tuple(tokens[at : at + new])
    if old:
        return tuple(tokens[source : source + old]), written
    if source == 0:
        return None
    before = tokens[source - 1]
    return (before,), (before, *written)


def apply_rules(tokens: list[int], rules: dict[tuple[int, ...], tuple[int, ...]]) -> list[int]:
    """`tokens` with every occurrence of a rule's old tokens replaced by its new ones, scanning
    left to right; where rules overlap, the longest old sequence wins."""
    by_first: dict[int, list[Rule]] = {}
    for old, new in sorted(rules.items(), key=lambda rule: -len(rule[0])):
        by_first.setdefault(old[0], []).append((old, new))
    out: list[int] = []
    i = 0
    while i < len(tokens):
        for old, new in by_first.get(tokens[i], ()):
            if tuple(tokens[i : i + len(old)]) == old:
                out.extend(new)
                i += len(old)
                break
        else:
            out.append(tokens[i])
            i += 1
    return out


class EditedLookup:
    """Prompt lookup in one request's text with its learned edits applied (see the module docstring)."""

    def __init__(self, new_index: Callable[[], PromptLookupIndex], max_edit: int, max_rules: int) -> None:
        self.tracker = EditTracker(max_edit, max_rules)
        self._new_index = new_index
        #: The edited text: the rules applied before the first edit, the text as written after it.
        self._edited: list[int] = []
        #: How many tokens of the request's text `_edited` covers.
        self._covered = 0
        self._index: PromptLookupIndex | None = None

    def propose(self, tokens: list[int], plain: LookupMatch | None, k: int) -> LookupMatch | None:
        """The edited text's lookup of up to `k` tokens, or None; `plain` is the text's own
        lookup this round, the copy the tracker follows next."""
        changed = self.tracker.observe(tokens)
        self.tracker.follow(plain, len(tokens))
        cut = self.tracker.first_edit_at
        if cut is None or not self.tracker.rules:
            return None
        if changed or self._index is None:
            self._edited = apply_rules(tokens[:cut], self.tracker.rules) + tokens[cut:]
            self._index = self._new_index()
        else:
            self._edited.extend(tokens[self._covered :])
        self._covered = len(tokens)
        self._index.update(self._edited)
        return self._index.propose(self._edited, k)
