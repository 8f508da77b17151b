"""One request's walk through its grammar: the allowed tokens along a round's tokens, and the
grammar's state moved past each token the request emits."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import llguidance
import numpy as np
import torch

from specdec.errors import ServiceStateError
from specdec.sampling.token_masks import TokenMasks, words_for


class RequestGrammar:
    """An llguidance matcher that has consumed exactly the request's emitted tokens, and the
    grammar `text` it was compiled from."""

    def __init__(self, matcher: llguidance.LLMatcher, text: str, vocab_size: int,
                 stop_token_ids: Collection[int]) -> None:
        self.matcher, self.text = matcher, text
        self.words = words_for(vocab_size)  # the logits' width; the tokenizer's may be wider
        self.stop_token_ids = frozenset(stop_token_ids)

    def row(self) -> torch.Tensor:
        """The tokens allowed next: packed words [W] int32."""
        packed = np.frombuffer(self.matcher.compute_bitmask(), dtype="<i4")[: self.words]
        return torch.from_numpy(packed.astype(np.int32))

    def masks_along(self, tokens: Sequence[int]) -> tuple[TokenMasks, int]:
        """The rows of a verify [g, t1..tK] (g already emitted): row i allows what may follow the
        emitted tokens and t1..ti. Stops at the first draft token the grammar refuses: returns the
        rows up to it (legal + 1 of them) and `legal`, the draft tokens before it. The state is
        left where it was. Nothing follows a stop token: its row is never used, and repeats the
        one before."""
        rows = [self.row()]
        consumed = legal = 0
        for token in tokens:
            if not _allows(rows[-1], token):
                break
            legal += 1
            if token in self.stop_token_ids:
                rows.append(rows[-1])
                break
            if not self.matcher.consume_token(token):
                self._check()
                raise ServiceStateError(f"the grammar allowed token {token} and then refused it")
            consumed += 1
            rows.append(self.row())
        self.rollback(consumed)
        self._check()
        return TokenMasks.stack(rows), legal

    def advance(self, tokens: Sequence[int], stop_token_ids: Collection[int]) -> None:
        """Move past tokens the request emitted (through its first stop token: nothing after
        one is part of the answer). Each was drawn under this grammar's mask."""
        for token in tokens:
            if token in stop_token_ids and self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(token):
                self._check()
                raise ServiceStateError(f"token {token} was emitted where the grammar does not allow it")
            if token in stop_token_ids:
                return

    def rollback(self, tokens: int) -> None:
        """Undo the last `tokens` tokens consumed."""
        if tokens and not self.matcher.rollback(tokens):
            self._check()
            raise ServiceStateError(f"the grammar could not roll back {tokens} tokens")

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar allows alone from here (its only continuation), possibly none."""
        return list(self.matcher.compute_ff_tokens())

    @property
    def complete(self) -> bool:
        """Nothing may follow but a stop token."""
        return bool(self.matcher.is_stopped())

    def _check(self) -> None:
        if self.matcher.is_error():
            raise ServiceStateError(f"the grammar failed: {self.matcher.get_error()}")


def _allows(row: torch.Tensor, token: int) -> bool:
    word = token >> 5
    return word < row.shape[0] and bool((int(row[word]) >> (token & 31)) & 1)
