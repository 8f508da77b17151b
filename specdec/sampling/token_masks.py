"""The tokens a grammar allows, row by row: packed bits, as grammar engines fill them.

A structured-output request's gateway walks its grammar along the round's tokens and sends the
target one row per verify row; the target sets every other token's logit to -inf before the
request's transforms, so each row's p is the grammar-constrained distribution. The packing is
llguidance's bitmask layout: bit j of int32 word w allows token 32 * w + j.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec.errors import InvalidArgumentError

#: Tokens per packed word.
BITS = 32
_SHIFTS = torch.arange(BITS, dtype=torch.int32)  # [32]


def words_for(vocab: int) -> int:
    """Packed words a row of `vocab` tokens needs."""
    return -(-vocab // BITS)


@dataclass(frozen=True)
class TokenMasks:
    """`words` [rows, W] int32: row r allows token t when bit t % 32 of word t // 32 is set."""

    words: torch.Tensor

    def __post_init__(self) -> None:
        if self.words.dtype != torch.int32 or self.words.dim() != 2:
            raise ValueError(f"mask words must be int32 [rows, W], got {self.words.dtype} {list(self.words.shape)}")

    @property
    def rows(self) -> int:
        return self.words.shape[0]

    @classmethod
    def stack(cls, rows: Sequence[torch.Tensor]) -> TokenMasks:
        """Masks from per-row packed words ([W] int32 each)."""
        return cls(torch.stack(list(rows)))

    @classmethod
    def from_allowed(cls, allowed: torch.Tensor) -> TokenMasks:
        """Packed from a bool [rows, vocab]."""
        rows, vocab = allowed.shape
        padded = torch.zeros(rows, words_for(vocab) * BITS, dtype=torch.int64)
        padded[:, :vocab] = allowed
        words = (padded.view(rows, -1, BITS) << _SHIFTS.to(torch.int64)).sum(-1)  # [rows, W], 0..2^32-1
        return cls(torch.where(words >= 2**31, words - 2**32, words).to(torch.int32))

    def allowed(self, vocab: int) -> torch.Tensor:
        """[rows, vocab] bool."""
        return torch.from_numpy(self._bits(vocab)).view(torch.bool)

    def _bits(self, vocab: int) -> np.ndarray:
        """[rows, vocab] uint8 0/1."""
        # Little-endian words: byte b of word w holds tokens 32w + 8b .. +7, lowest bit first.
        packed = self.words.contiguous().numpy().view(np.uint8)  # [rows, 4W]
        return np.unpackbits(packed, axis=-1, count=vocab, bitorder="little")

    def allows(self, row: int, token: int) -> bool:
        return bool((int(self.words[row, token // BITS]) >> (token % BITS)) & 1)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [rows, vocab] with every token the row does not allow at -inf (a new tensor)."""
        # `where` with a scalar: masked_fill with the negated mask took 2-3x as long on CPU
        # (docs/performance.md#grammar-engine).
        allowed = self.allowed(logits.shape[-1]).to(logits.device)
        return torch.where(allowed, logits, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))

    def check(self, rows: int, vocab: int, where: str) -> None:
        """INVALID_ARGUMENT unless there are `rows` rows wide enough for `vocab`, each allowing a token."""
        if self.rows != rows:
            raise InvalidArgumentError(f"{where}: {self.rows} mask rows for {rows} rows of logits", field=where)
        if self.words.shape[1] < words_for(vocab):
            raise InvalidArgumentError(f"{where}: {self.words.shape[1]} words a row cannot cover {vocab} tokens",
                                       field=where)
        if not self._bits(vocab).any(axis=-1).all():  # numpy's: torch's any over [16, 49152] took ms
            raise InvalidArgumentError(f"{where}: a mask row allows no token of the vocabulary", field=where)

    def to_bytes(self) -> bytes:
        return self.words.contiguous().numpy().astype("<i4").tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, rows: int, words_per_row: int) -> TokenMasks:
        if rows < 0 or words_per_row <= 0 or len(data) != 4 * rows * words_per_row:
            raise InvalidArgumentError(f"allowed: {len(data)} bytes for {rows} rows of {words_per_row} words",
                                       field="allowed")
        words = torch.frombuffer(bytearray(data), dtype=torch.int32) if data else torch.zeros(0, dtype=torch.int32)
        return cls(words.view(rows, words_per_row))
