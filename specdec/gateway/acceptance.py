"""The accept phase of a round: each draft's accepted prefix plus one recovered or bonus token.

The target answered each drafting request in the mode the gateway asked for
(`specdec.wire.items.VerifyMode`): argmax tokens for a greedy request with untransformed
logits, raw logits for a greedy request whose argmax a logit bias or a penalty may move
(`transforms.chunk_adjust_logits` applied here, the penalties' context growing through the
draft tokens), for a seeded sampled request its own draw at each position (kept while they
equal the draft tokens, as argmax tokens are), and for an unseeded sampled request the K + 1
candidates and p_i(t_i) that it drew and computed with the request's transforms. Each kind is
judged in one batched call of `specdec.sampling.rejection_sampler`, whose tensors become host
lists once per call (`RejectionResult.token_lists`). Pure tensor work: it runs on the gateway's
sampler thread.
"""

from __future__ import annotations

from typing import TypeVar

import torch

from specdec.errors import ServiceStateError
from specdec.gateway.request import Request, Verification
from specdec.sampling.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    accept_candidates,
    greedy_accept,
    greedy_accept_argmax,
)
from specdec.sampling.token_masks import TokenMasks
from specdec.sampling.transforms import chunk_adjust_logits, stack_chunks
from specdec.wire.items import (
    Proposal,
    VerifiedArgmax,
    VerifiedChunk,
    VerifiedDrawn,
    VerifiedLogits,
    VerifiedSampled,
)

C = TypeVar("C", VerifiedArgmax, VerifiedDrawn, VerifiedLogits, VerifiedSampled)


def accept_all(
    seqs: list[Request], verified: dict[str, VerifiedChunk], proposals: dict[str, Proposal],
    masks: dict[str, TokenMasks] | None = None,
) -> dict[str, list[int]]:
    """Judge every drafting request of the round (each has a proposal); one call per kind. Per
    slot: its accepted draft tokens, then one recovered or bonus token (so len - 1 were accepted).
    The target applied structured-output requests' grammar `masks` to all but raw logits: here."""
    masks = masks or {}
    by_argmax = [s for s in seqs if s.sampling.is_greedy and s.sampling.greedy_by_raw_argmax]
    greedy = [s for s in seqs if s.sampling.is_greedy and not s.sampling.greedy_by_raw_argmax]
    drawn = [s for s in seqs if not s.sampling.is_greedy and s.verification is Verification.DRAWN]
    sampled = [s for s in seqs if not s.sampling.is_greedy and s.verification is Verification.REJECTION]
    results: dict[str, list[int]] = {}
    # The target's argmax or its draw at each position: keep draft tokens while they equal it.
    matched = by_argmax + drawn
    if matched:
        best = [_answer(verified, s, VerifiedArgmax).tokens for s in by_argmax]
        best += [_answer(verified, s, VerifiedDrawn).tokens for s in drawn]
        tokens, ks = _padded_drafts(matched, proposals)  # [A, K_max]
        results |= _by_slot(matched, greedy_accept_argmax(_padded_rows(matched, best, ks), tokens, ks).token_lists())
    if greedy:
        logits = [masked(_answer(verified, s, VerifiedLogits).logits, masks.get(s.slot_id)) for s in greedy]
        tokens, ks = _padded_drafts(greedy, proposals)  # [G, K_max]
        scores = stack_chunks(logits, tokens.shape[1] + 1)  # [G, K_max+1, vocab]
        drafted = [proposals[s.slot_id].tokens for s in greedy]
        scores = chunk_adjust_logits(scores, [s.sampling for s in greedy], [s.tokens for s in greedy], drafted)
        results |= _by_slot(greedy, greedy_accept(scores, tokens, ks).token_lists())
    if sampled:
        answers = [_answer(verified, s, VerifiedSampled) for s in sampled]
        tokens, ks = _padded_drafts(sampled, proposals)  # [S, K_max]
        candidates = _padded_rows(sampled, [a.candidates for a in answers], ks)  # [S, K_max+1]
        p, q = _padded_probs(sampled, answers, proposals, ks)  # [S, K_max] each
        judged = accept_candidates(p, q, tokens, ks, candidates, [s.generator for s in sampled])
        results |= _by_slot(sampled, judged.token_lists())
    return results


def masked(logits: torch.Tensor, masks: TokenMasks | None) -> torch.Tensor:
    """Raw logits [rows, vocab] under a grammar's masks, if the request has them."""
    return logits if masks is None else masks.apply(logits)


def _answer(verified: dict[str, VerifiedChunk], seq: Request, kind: type[C]) -> C:
    chunk = verified[seq.slot_id]
    if not isinstance(chunk, kind):
        raise ServiceStateError(f"the target answered slot {seq.slot_id} with {type(chunk).__name__}, "
                                f"the gateway asked for {kind.__name__}")
    return chunk


def _padded_drafts(seqs: list[Request], proposals: dict[str, Proposal]) -> tuple[torch.Tensor, list[int]]:
    """Draft tokens [B, K_max] (PLACEHOLDER_TOKEN_ID past each row's K) and each row's K."""
    drafted = [proposals[s.slot_id].tokens for s in seqs]
    ks = [len(d) for d in drafted]
    k_max = max(ks)
    tokens = torch.tensor([d + [PLACEHOLDER_TOKEN_ID] * (k_max - len(d)) for d in drafted], dtype=torch.long)
    return tokens.view(len(seqs), k_max), ks


def _padded_rows(seqs: list[Request], rows: list[list[int]], ks: list[int]) -> torch.Tensor:
    """The target's K + 1 tokens per request (argmax tokens or candidates) as [B, K_max+1],
    PLACEHOLDER_TOKEN_ID past each row's K + 1."""
    width = max(ks) + 1
    for seq, k, row in zip(seqs, ks, rows):
        if len(row) != k + 1:
            raise ServiceStateError(f"the target sent {len(row)} tokens for slot {seq.slot_id}, "
                                    f"the gateway expected {k + 1}")
    return torch.tensor([row + [PLACEHOLDER_TOKEN_ID] * (width - len(row)) for row in rows],
                        dtype=torch.long).view(len(rows), width)


def _padded_probs(
    seqs: list[Request], answers: list[VerifiedSampled], proposals: dict[str, Proposal], ks: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampled round's p_i(t_i) (from the target) and q_i(t_i) (from the draft's q), each
    [B, K_max], 1.0 past each row's K (never judged)."""
    p = torch.ones(len(seqs), max(ks))  # [B, K_max]
    q = torch.ones(len(seqs), max(ks))  # [B, K_max]
    for b, (seq, answer, k) in enumerate(zip(seqs, answers, ks)):
        proposal = proposals[seq.slot_id]
        if len(answer.target_probs) != k or proposal.probs is None:
            raise ServiceStateError(f"the target sent {len(answer.target_probs)} probabilities for slot {seq.slot_id}, "
                                    f"the gateway expected {k}")
        p[b, :k] = torch.tensor(answer.target_probs)
        q[b, :k] = proposal.probs.probs_of(proposal.tokens)
    return p, q


def _by_slot(seqs: list[Request], rows: list[list[int]]) -> dict[str, list[int]]:
    return {seq.slot_id: row for seq, row in zip(seqs, rows)}
