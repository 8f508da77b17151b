"""The logprobs of each emitted token, for the requests that ask (`Request.logprobs`).

Every one is the target's own row at the token's position, conditioned on the accepted prefix:
* the first token (and a resumed request's next one): the Prefill logits, here;
* a drafting round answered with Argmax or Sampled: the target's `RowLogprobs` of the item,
  rows 0..n-1's drafted entries for the n accepted draft tokens, row n's answered entry for
  the recovered or bonus token (the candidate / argmax the round emits);
* a drafting round answered with Logits (greedy with transforms): those rows, here;
* a plain round (Decode): the target's row per decoded token.
Rows of a verify equal the rows plain decoding computes one token at a time, so the values
are plain decoding's whether the round speculated or not.
"""

from __future__ import annotations

import torch

from specdec.errors import ServiceStateError
from specdec.gateway.acceptance import masked
from specdec.gateway.request import Request
from specdec.sampling.logprobs import LogprobsRequest, RowLogprobs, TokenLogprob, answer_rows
from specdec.sampling.token_masks import TokenMasks
from specdec.wire.items import Proposal, VerifiedChunk, VerifiedDecode, VerifiedLogits


def first_logprobs(seqs: list[Request], logits: dict[str, torch.Tensor], firsts: dict[str, int],
                   masks: dict[str, TokenMasks] | None = None) -> dict[str, list[TokenLogprob]]:
    """The first token's logprobs of each sequence that asks, from its Prefill logits [vocab]
    (under its grammar's one-row `masks` for transformed logprobs)."""
    masks = masks or {}
    asking = [(s, s.logprobs) for s in seqs if s.logprobs is not None]
    if not asking:
        return {}
    rows = answer_rows([_processed(logits[s.slot_id][None], r, masks.get(s.slot_id)) for s, r in asking],
                       [r for _, r in asking],
                       [s.tokens for s, _ in asking], [[] for _ in asking], [[firsts[s.slot_id]] for s, _ in asking])
    return {s.slot_id: r.emitted([firsts[s.slot_id]], 0) for (s, _), r in zip(asking, rows)}


def round_logprobs(
    seqs: list[Request], proposals: dict[str, Proposal], verified: dict[str, VerifiedChunk],
    accepted: dict[str, list[int]], masks: dict[str, TokenMasks] | None = None,
) -> dict[str, list[TokenLogprob]]:
    """The logprobs of the tokens this round emits, per sequence that asks (before `advance_all`
    moves the sequences): from the target's rows, or from its logits for a Logits answer (under
    the request's grammar `masks` for transformed logprobs, raw ones being the model's own).
    `accepted` holds each drafting request's emitted tokens (`acceptance.accept_all`)."""
    masks = masks or {}
    out: dict[str, list[TokenLogprob]] = {}
    from_logits: list[tuple[Request, LogprobsRequest, VerifiedLogits, list[int], int]] = []
    for seq in seqs:
        slot, request, chunk = seq.slot_id, seq.logprobs, verified[seq.slot_id]
        if request is None:
            continue
        if isinstance(chunk, VerifiedDecode):
            out[slot] = _checked(seq, chunk.logprobs, request, len(chunk.tokens), 0).emitted(chunk.tokens, 0)
            continue
        tokens = accepted[slot]
        num_accepted = len(tokens) - 1  # the last is the recovered or bonus token
        if isinstance(chunk, VerifiedLogits):
            from_logits.append((seq, request, chunk, tokens, num_accepted))
            continue
        k = len(proposals[slot].tokens)
        out[slot] = _checked(seq, chunk.logprobs, request, k + 1, k).emitted(tokens, num_accepted)
    if from_logits:
        logits = [_processed(c.logits, r, masks.get(s.slot_id))[: len(t)] for s, r, c, t, _ in from_logits]
        rows = answer_rows(logits, [r for _, r, *_ in from_logits],
                           [s.tokens for s, *_ in from_logits], [t[:n] for *_, t, n in from_logits],
                           [t for *_, t, _ in from_logits])
        out |= {s.slot_id: r.emitted(t, 0) for (s, _, _, t, _), r in zip(from_logits, rows)}
    return out


def _processed(logits: torch.Tensor, request: LogprobsRequest, masks: TokenMasks | None) -> torch.Tensor:
    """The rows transformed logprobs start from: a grammar's masks apply to them, not to raw ones."""
    return logits if request.transforms is None else masked(logits, masks)


def _checked(seq: Request, rows: RowLogprobs | None, request: LogprobsRequest, n_rows: int,
             k: int) -> RowLogprobs:
    """The target's rows, if they are what the gateway asked for: else continuing would emit
    tokens without (or with misplaced) logprobs."""
    if (rows is None or len(rows.answered) != n_rows or len(rows.drafted) != k
            or any(len(top) != request.top for top in rows.top)):
        raise ServiceStateError(f"the target sent malformed logprobs for slot {seq.slot_id}: "
                                f"expected {n_rows} rows of {request.top} alternatives and {k} draft tokens")
    return rows
