"""The target's log-probabilities of tokens: what a request asks, and the pure tensor work.

A token's logprob is read from the TARGET's row at its position, conditioned on everything
before it, never from the draft's q or a residual: under speculation row i of a verify is
exactly the row plain decoding computes after the same prefix, so the logprobs of emitted
tokens are the plain-decoding ones whatever the round accepted.

Two distributions: raw (the model's log-softmax, vLLM's default) or processed (the log of
what `transforms.chunk_logits_to_probs` gives under the request's transforms, i.e. the
distribution a sampled token was drawn from). A greedy request has no such distribution (it
is one-hot), so its processed logprobs use its transforms at temperature 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.errors import InvalidArgumentError
from specdec.sampling.params import SamplingParams
from specdec.sampling.transforms import chunk_logits_to_probs, stack_chunks

#: Most alternatives a token may list (OpenAI's limit).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class LogprobsOptions:
    """What a client asks: `top` alternatives per token, from the raw or processed distribution."""

    top: int = 0
    processed: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.top <= MAX_TOP_LOGPROBS:
            raise InvalidArgumentError(f"logprobs.top_logprobs: {self.top} is outside [0, {MAX_TOP_LOGPROBS}]",
                                       field="logprobs.top_logprobs")

    def request_for(self, sampling: SamplingParams) -> LogprobsRequest:
        """What to ask the target (or compute here) for a request sampled with `sampling`."""
        if not self.processed:
            return LogprobsRequest(self.top)
        temperature = 1.0 if sampling.is_greedy else sampling.temperature
        return LogprobsRequest(self.top, dataclasses.replace(sampling, temperature=temperature, seed=None))


@dataclass(frozen=True)
class LogprobsRequest:
    """How to compute one item's logprobs: `top` alternatives per row, and the transforms of
    the processed distribution (None: the raw log-softmax)."""

    top: int = 0
    transforms: SamplingParams | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's logprob and the most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), the most likely first


@dataclass(frozen=True)
class RowLogprobs:
    """Logprobs per row of a chunk of target rows (a verify item's K + 1, or decoded steps)."""

    drafted: list[float]  # [K]: row i's logprob of the draft token t_{i+1}
    answered: list[float]  # [rows]: each row's logprob of its answer token
    top: list[list[tuple[int, float]]]  # [rows][top]: each row's most likely tokens, descending

    def emitted(self, tokens: Sequence[int], num_drafted: int) -> list[TokenLogprob]:
        """The logprobs of a round's emitted `tokens`: the first `num_drafted` are accepted draft
        tokens (their rows' drafted entries), the rest each row's answer token."""
        values = self.drafted[:num_drafted] + self.answered[num_drafted : len(tokens)]
        return [TokenLogprob(t, v, tuple(self.top[i])) for i, (t, v) in enumerate(zip(tokens, values))]

    @staticmethod
    def concat(parts: Sequence[RowLogprobs]) -> RowLogprobs:
        """Rows of consecutive chunks as one (a Decode item's steps; none of them drafted)."""
        return RowLogprobs([d for p in parts for d in p.drafted], [a for p in parts for a in p.answered],
                           [t for p in parts for t in p.top])


def chunk_logprobs(
    logits: torch.Tensor,  # [B, T, vocab]
    requests: Sequence[LogprobsRequest],  # one per batch row
    prior_context: Sequence[Sequence[int]],  # [B][*]: the tokens up to and including each chunk's first
    chunk_tokens: Sequence[Sequence[int]],  # [B][<= T-1]: the tokens after the first, fed at rows 1..
) -> torch.Tensor:
    """Log-probabilities [B, T, vocab] float32: the raw log-softmax, or for rows whose request
    has transforms the log of `chunk_logits_to_probs` (each position's penalty context
    growing through `chunk_tokens`, as the target's p)."""
    raw = [b for b, r in enumerate(requests) if r.transforms is None]
    processed = {b: r.transforms for b, r in enumerate(requests) if r.transforms is not None}
    if not processed:  # the usual batch: no row copied
        return torch.log_softmax(logits.float(), dim=-1)
    if not raw:
        return chunk_logits_to_probs(logits, list(processed.values()), prior_context, chunk_tokens).log()
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)  # [B, T, vocab]
    index = torch.tensor(raw, device=logits.device)  # [r]
    out.index_copy_(0, index, torch.log_softmax(logits.index_select(0, index).float(), dim=-1))
    index = torch.tensor(list(processed), device=logits.device)  # [s]
    probs = chunk_logits_to_probs(logits.index_select(0, index), list(processed.values()),
                                  [prior_context[b] for b in processed],
                                  [chunk_tokens[b] for b in processed])  # [s, T, vocab]
    return out.index_copy_(0, index, probs.log())


def answer_rows(
    rows: Sequence[torch.Tensor],  # [T_b, vocab] logits per item
    requests: Sequence[LogprobsRequest],
    prior_context: Sequence[Sequence[int]],
    drafted: Sequence[Sequence[int]],  # [T_b - 1] or fewer per item: the draft tokens t1..tK
    answers: Sequence[Sequence[int]],  # [T_b] per item: each row's answer token
) -> list[RowLogprobs]:
    """Each item's `RowLogprobs` over its logits rows, for the whole batch at once with one
    host copy per kind of value."""
    width = max(r.shape[0] for r in rows)
    logits = rows[0][None] if len(rows) == 1 else stack_chunks(rows, width)  # [B, T, vocab]
    logprobs = chunk_logprobs(logits, requests, prior_context, drafted)  # [B, T, vocab]
    device = logprobs.device
    draft_ids = _padded([list(d) for d in drafted], width, device)  # [B, T]
    answer_ids = _padded([list(a) for a in answers], width, device)  # [B, T]
    drafted_lp = logprobs.gather(2, draft_ids.clamp(min=0)[..., None])[..., 0].tolist()  # [B, T]
    answered_lp = logprobs.gather(2, answer_ids.clamp(min=0)[..., None])[..., 0].tolist()  # [B, T]
    n_top = max(r.top for r in requests)
    top_values, top_ids = logprobs.topk(n_top, dim=-1) if n_top else (logprobs[..., :0], logprobs[..., :0].long())
    top_values_host, top_ids_host = top_values.tolist(), top_ids.tolist()  # [B, T, n_top] each
    out = []
    for b, (request, chunk) in enumerate(zip(requests, rows)):
        n_rows = chunk.shape[0]
        top = [list(zip(top_ids_host[b][i][: request.top], top_values_host[b][i][: request.top]))
               for i in range(n_rows)]
        out.append(RowLogprobs(drafted_lp[b][: len(drafted[b])], answered_lp[b][:n_rows], top))
    return out


def _padded(rows: list[list[int]], width: int, device: torch.device) -> torch.Tensor:
    """Token ids [B, width], -1 past each row's end."""
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int64, device=device).view(-1, width)
