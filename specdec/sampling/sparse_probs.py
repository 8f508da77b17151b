"""The draft's q as it travels: each row cut to the tokens that carry its mass.

Speculative sampling is exact for any proposal distribution q, provided the draft samples
from the very q that acceptance judges against (docs/architecture.md#exactness-contract). So
the draft may cut q's tail before it samples: every probability below `MIN_DRAFT_PROB` is
dropped, and the rest is the distribution (its values divided by their sum). What the cut
can cost is acceptance, by at most the mass it removes, and that mass is small; a row then
travels as a few hundred token ids and values instead of a vocabulary-wide row
(docs/performance.md#sparse-draft-rows).

The dense rows in this module are all [rows, vocab]; `SparseRows` stores them flat.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.errors import InvalidArgumentError

#: Probabilities below this are cut from the draft's q (see the module docstring).
MIN_DRAFT_PROB = 1e-5


def cut_tail(probs: torch.Tensor) -> torch.Tensor:
    """`probs` [n, vocab] with entries below `MIN_DRAFT_PROB` set to zero; a row's largest
    entry is always kept (a near-uniform row over a vocabulary above 100k tokens has all
    its entries below the threshold)."""
    floor = probs.amax(dim=-1, keepdim=True).clamp(max=MIN_DRAFT_PROB)  # [n, 1]
    return torch.where(probs >= floor, probs, torch.zeros((), dtype=probs.dtype, device=probs.device))


@dataclass(frozen=True)
class SparseRows:
    """Rows of (unnormalized) probabilities, zero outside each row's support: row r's
    entries are the next `lengths[r]` of `token_ids` and `values`."""

    lengths: tuple[int, ...]
    token_ids: torch.Tensor  # [nnz] int64
    values: torch.Tensor  # [nnz], in the dtype they travel in

    @classmethod
    def from_dense(cls, rows: torch.Tensor) -> SparseRows:
        """The nonzero entries of `rows` [n, vocab], row by row."""
        row_index, token_ids = rows.nonzero(as_tuple=True)  # [nnz] each, row-major
        lengths = torch.bincount(row_index, minlength=rows.shape[0])  # [n]
        return cls(tuple(lengths.tolist()), token_ids, rows[row_index, token_ids])

    @classmethod
    def one_hot(cls, tokens: list[int] | tuple[int, ...]) -> SparseRows:
        """Row r certain of tokens[r]: the q of a deterministic draft (a lookup). Verified
        against it, t_r is kept with probability p_r(t_r), and a rejection draws from p_r
        without t_r, which leaves the target's distribution exact
        (docs/architecture.md#exactness-contract)."""
        return cls((1,) * len(tokens), torch.tensor(tokens, dtype=torch.int64), torch.ones(len(tokens)))

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    def head(self, rows: int) -> SparseRows:
        """The first `rows` rows."""
        end = sum(self.lengths[:rows])
        return SparseRows(self.lengths[:rows], self.token_ids[:end], self.values[:end])

    def _row_index(self) -> torch.Tensor:
        """Each entry's row: [nnz] int64."""
        lengths = torch.tensor(self.lengths, dtype=torch.int64, device=self.token_ids.device)
        return torch.repeat_interleave(torch.arange(self.num_rows, device=lengths.device), lengths)

    def _row_sums(self, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Each row's sum of `values` [nnz] (entry rows `rows` [nnz]): [rows] float32."""
        return torch.zeros(self.num_rows, dtype=torch.float32, device=values.device).index_add_(0, rows, values)

    def _normalized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each entry's row [nnz] and its value divided by its row's sum [nnz] float32: the
        one computation of q that the gateway and the target share."""
        rows = self._row_index()
        values = self.values.float()
        return rows, values / self._row_sums(rows, values)[rows]

    def distributions(self, vocab: int, extra_rows: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
        """The rows as normalized float32 distributions [rows + extra_rows, vocab] on `device`
        (default: where the rows are), exactly the distributions the draft sampled from;
        `extra_rows` zero rows follow (the bonus position has no q)."""
        rows, probs = self._normalized()
        dense = torch.zeros(self.num_rows + extra_rows, vocab, dtype=torch.float32, device=device or probs.device)
        dense[rows.to(dense.device), self.token_ids.to(dense.device)] = probs.to(dense.device)
        return dense

    def probs_of(self, tokens: list[int]) -> torch.Tensor:
        """q_r(tokens[r]) for each row r, normalized as in `distributions`: [rows] float32,
        0 for a token outside its row's support."""
        if len(tokens) != self.num_rows:
            raise InvalidArgumentError(f"probs_of: {len(tokens)} tokens for {self.num_rows} rows")
        rows, probs = self._normalized()
        wanted = torch.tensor(tokens, dtype=torch.int64, device=rows.device)[rows] == self.token_ids  # [nnz]
        return self._row_sums(rows, torch.where(wanted, probs, 0.0))

    def validate(self, vocab: int, field: str) -> None:
        """Raise InvalidArgumentError, naming `field`, unless these are well-formed rows over `vocab` tokens."""
        nnz = self.token_ids.numel()
        if any(n < 1 for n in self.lengths) or sum(self.lengths) != nnz or self.values.shape != (nnz,):
            raise InvalidArgumentError(
                f"{field}: row lengths {list(self.lengths)} (each at least 1) must add up to the {nnz} token ids "
                f"and the {self.values.numel()} values", field=field
            )
        if nnz and (int(self.token_ids.min()) < 0 or int(self.token_ids.max()) >= vocab):
            raise InvalidArgumentError(f"{field}: token ids must lie in [0, {vocab})", field=field)
        values = self.values.float()
        if not bool(torch.isfinite(values).all()) or bool((values < 0).any()):
            raise InvalidArgumentError(f"{field}: values must be finite and non-negative", field=field)
        rows = self._row_index()
        if torch.unique(rows * vocab + self.token_ids).numel() != nnz:
            raise InvalidArgumentError(f"{field}: a token appears twice in one row", field=field)
        if bool((self._row_sums(rows, values) <= 0).any()):
            raise InvalidArgumentError(f"{field}: every row needs a positive sum", field=field)

    def check_drafted(self, tokens: list[int], vocab: int, field: str) -> None:
        """Raise InvalidArgumentError, naming `field`, unless these rows are a q the draft can
        have drawn `tokens` from: well-formed over `vocab` tokens, one row per drafted token,
        each token with a chance in its row. The gateway checks what the draft sent, and the
        target what the gateway forwards."""
        self.validate(vocab, field)
        if self.num_rows != len(tokens):
            raise InvalidArgumentError(f"{field}: {self.num_rows} rows of q for {len(tokens)} draft tokens",
                                       field=field)
        if bool((self.probs_of(tokens) <= 0).any()):
            raise InvalidArgumentError(f"{field}: a draft token has probability 0 in the q it was drawn from",
                                       field=field)
