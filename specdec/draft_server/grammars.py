"""Each structured-output slot's grammar in the draft: walked to the slot's answer so far at every
Propose, it masks each row the draft draws from (so no drafted token is one the target's masked
p refuses) and names the tokens it forces, which the draft feeds as guesses and then draws for
certain, without a step each.

The draft is only ever a speed-up: a grammar it cannot walk (refused, out of step with the
gateway's) leaves its slot drafting unmasked, and the gateway cuts the draft where its own walk
refuses a token.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

from specdec.errors import InvalidArgumentError, ServiceStateError
from specdec.grammar import GrammarCompiler, RequestGrammar
from specdec.sampling.token_masks import TokenMasks
from specdec.wire.items import DraftGrammar

log = logging.getLogger(__name__)

#: Longest a Propose waits for the grammar vocabulary still being built (then it drafts unmasked).
VOCABULARY_WAIT_S = 30.0


@dataclass
class SlotGrammar:
    """A slot's walk: `grammar` has consumed `answer` (the accepted tokens from `start` on), then
    `drafted` tokens of the Propose under way."""

    grammar: RequestGrammar
    start: int
    forced_guesses: bool
    answer: list[int] = field(default_factory=list)
    drafted: int = 0

    def sync(self, accepted: list[int], valid_len: int, stop_token_ids: tuple[int, ...]) -> None:
        """Walk to `accepted` (the slot's tokens after the feed), of which the first `valid_len`
        are the ones the draft kept: the walk keeps what it consumed of those."""
        self.end_draft()
        keep = min(len(self.answer), max(0, valid_len - self.start))
        if keep < len(self.answer):
            self.grammar.rollback(len(self.answer) - keep)
            del self.answer[keep:]
        new = accepted[self.start + keep:]
        self.grammar.advance(new, stop_token_ids)
        self.answer.extend(new)

    def mask(self) -> torch.Tensor:
        """The tokens allowed at the next draw, packed [W] int32."""
        return self.grammar.row()

    def draw(self, token: int, stop_token_ids: tuple[int, ...]) -> None:
        """Move past a drafted token (drawn under `mask`). Past a stop token, or the grammar's
        end (whose mask allows an end token alone), there is nothing to walk."""
        if token not in stop_token_ids and not self.grammar.complete:
            self.grammar.advance([token], stop_token_ids)
            self.drafted += 1

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar allows alone from here (none unless `forced_guesses`)."""
        if not self.forced_guesses or limit <= 0 or self.grammar.complete:
            return []
        return self.grammar.forced_tokens()[:limit]

    def end_draft(self) -> None:
        """Back to the accepted answer: the drafted tokens are the gateway's to judge."""
        if self.drafted:
            self.grammar.rollback(self.drafted)
            self.drafted = 0


class DraftGrammars:
    """The walks of the draft's structured-output slots, compiled with the draft's tokenizer. Its
    grammar vocabulary (a second for 50k tokens, several for 128k) is built on a thread from the
    start, while the service loads and warms up; a grammar Propose waits for it if it must."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.slots: dict[str, SlotGrammar] = {}
        self._ready = threading.Event()
        threading.Thread(target=self._build, name="grammar-vocabulary", daemon=True).start()

    def walk(self, slot_id: str, grammar: DraftGrammar | None, accepted: list[int], valid_len: int,
             stop_token_ids: tuple[int, ...]) -> SlotGrammar | None:
        """The slot's walk, at `accepted` (its tokens after this Propose's feed); None where the
        slot drafts unmasked."""
        if grammar is None or not self._ready.wait(VOCABULARY_WAIT_S):
            self.slots.pop(slot_id, None)
            return None
        slot = self.slots.get(slot_id)
        try:
            if slot is None or slot.grammar.text != grammar.text or slot.start != grammar.start:
                slot = SlotGrammar(self.compiler.compile(grammar.text, "grammar.text"), grammar.start,
                                   grammar.forced_guesses)
                self.slots[slot_id] = slot
            slot.forced_guesses = grammar.forced_guesses
            slot.sync(accepted, valid_len, stop_token_ids)
        except (InvalidArgumentError, ServiceStateError) as error:
            log.warning("slot %s drafts without its grammar: %s", slot_id, error)
            self.slots.pop(slot_id, None)
            return None
        return slot

    def end_drafts(self) -> None:
        for slot in self.slots.values():
            slot.end_draft()

    def release(self, slot_id: str) -> None:
        self.slots.pop(slot_id, None)

    def _build(self) -> None:
        self.compiler.warm()
        self._ready.set()


def masked(step_logits: torch.Tensor, walks: list[SlotGrammar | None]) -> torch.Tensor:
    """`step_logits` [n, vocab] with row j cut to what walks[j] allows (rows without a walk as they are)."""
    rows = [j for j, walk in enumerate(walks) if walk is not None]
    if not rows:
        return step_logits
    masks = TokenMasks.stack([walks[j].mask() for j in rows])  # type: ignore[union-attr]
    out = step_logits.clone()
    out[rows] = masks.apply(step_logits[rows])
    return out
