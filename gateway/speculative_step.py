"""One speculation round, phase by phase: plan, propose, verify, accept, advance.

`run_round` reads top to bottom as the algorithm: the draft proposes K tokens per request
(one batched Propose), the target scores [g, t1..tK] per request (one batched Verify),
the rejection sampler accepts a prefix and adds a recovered or bonus token, and each
sequence's valid cache lengths move forward — which is the implicit rollback of both
caches on the next round.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import grpc
import torch

from gateway.model_clients import DraftClient, DraftProposal, TargetClient
from gateway.sequence import Sequence
from specdec.rpc_items import ProposeItem, VerifyItem
from specdec.sampling.rejection_sampler import RejectionResult, greedy_accept, rejection_sample
from specdec.sampling.transforms import (
    chunk_apply_repetition_penalty,
    chunk_logits_to_probs,
    logits_to_probs,
    sample,
)
from specdec.serving.worker import ModelWorker

log = logging.getLogger(__name__)


def plan_k(seq: Sequence, max_seq_len: int) -> int:
    """Draft length for this round: the request's K, shrunk so that the K+1 tokens a round
    may emit fit both max_seq_len and max_new_tokens (0 = plain decoding)."""
    room = min(max_seq_len - len(seq.tokens), seq.max_new_tokens - seq.completion_tokens) - 1
    return max(0, min(seq.spec_length, room))


async def propose(draft: DraftClient | None, seqs: list[Sequence], ks: dict[str, int]) -> dict[str, DraftProposal]:
    """One batched Propose for every sequence with K >= 1."""
    speculating = [s for s in seqs if ks[s.slot_id] > 0]
    if not speculating:
        return {}
    if draft is None:
        raise RuntimeError("K > 0 was planned without a draft service")
    for seq in speculating:
        seq.has_draft_slot = True  # from now on the draft may hold a slot: release it at the end
    return await draft.propose([
        ProposeItem(s.slot_id, s.draft_valid, s.tokens[s.draft_valid :], ks[s.slot_id], s.draft_sampling)
        for s in speculating
    ])


async def verify(target: TargetClient, seqs: list[Sequence], proposals: dict[str, DraftProposal]) -> dict[str, torch.Tensor]:
    """One batched Verify: [pending tokens, t1..tK] after each sequence's valid prefix."""
    empty = DraftProposal(tokens=[], probs=None)
    return await target.verify([
        VerifyItem(s.slot_id, s.target_valid, s.tokens[s.target_valid :] + proposals.get(s.slot_id, empty).tokens)
        for s in seqs
    ])


def accept(seq: Sequence, logits: torch.Tensor, proposal: DraftProposal | None) -> RejectionResult:
    """Accept a prefix of the draft and add one recovered or bonus token.

    `logits` [K+1, vocab] are the target's raw logits; they get the request's transforms
    here, with the repetition-penalty context growing through the draft tokens — the same
    context the draft used for q.
    """
    drafted = proposal.tokens if proposal else []
    k = len(drafted)
    tokens = torch.tensor([drafted], dtype=torch.long).view(1, k)  # [1, K]
    if seq.sampling.is_greedy:
        scores = logits[None].float()  # [1, K+1, vocab]
        if seq.sampling.repetition_penalty != 1.0:
            scores = chunk_apply_repetition_penalty(scores, [seq.tokens], [drafted], seq.sampling.repetition_penalty)
        return greedy_accept(scores, tokens, [k])
    p = chunk_logits_to_probs(logits[None], [seq.sampling], [seq.tokens], [drafted])  # [1, K+1, vocab]
    q = proposal.probs[None] if proposal and proposal.probs is not None else p.new_zeros(1, 0, p.shape[-1])  # [1, K, vocab]
    return rejection_sample(p, q, tokens, [k], [seq.generator])


def advance(seq: Sequence, k: int, num_accepted: int) -> None:
    """Move the valid cache lengths past the accepted tokens (before emitting them).

    The target cached [pending..., t1..tK]: everything up to t_n is valid. The draft cached
    the sequence plus t1..t_{K-1} (the last draft token is never fed back).
    """
    length = len(seq.tokens)
    seq.target_valid = length + num_accepted
    if k > 0:
        seq.draft_valid = length + min(num_accepted, k - 1)


def accept_all(
    seqs: list[Sequence], logits: dict[str, torch.Tensor], proposals: dict[str, DraftProposal]
) -> dict[str, RejectionResult]:
    """`accept` for every sequence: pure tensor work, run on the gateway's sampler thread."""
    return {s.slot_id: accept(s, logits[s.slot_id], proposals.get(s.slot_id)) for s in seqs}


def first_tokens(seqs: list[Sequence], logits: dict[str, torch.Tensor]) -> dict[str, int]:
    """The first completion token of each newly prefilled sequence, from its last-prompt logits."""
    out = {}
    for seq in seqs:
        probs = logits_to_probs(logits[seq.slot_id][None], [seq.sampling], [seq.prompt])  # [1, vocab]
        out[seq.slot_id] = int(probs.argmax()) if seq.sampling.is_greedy else int(sample(probs, [seq.generator])[0])
    return out


@dataclass(frozen=True)
class RoundReport:
    """What one round did, for statistics: K and accepted count per slot, and phase times."""

    ks: dict[str, int]
    num_accepted: dict[str, int]
    propose_s: float
    verify_s: float
    #: Propose failed and the round ran as plain decoding.
    draft_failed: bool = False


async def run_round(
    target: TargetClient, draft: DraftClient | None, seqs: list[Sequence], max_seq_len: int, sampler: ModelWorker
) -> RoundReport:
    """Propose, verify, accept and advance every sequence by one round."""
    ks = {s.slot_id: plan_k(s, max_seq_len) if draft is not None else 0 for s in seqs}
    started = time.perf_counter()
    draft_error = None
    try:
        proposals = await propose(draft, seqs, ks)
    except grpc.aio.AioRpcError as error:
        # The draft only ever speeds things up: without it the round is plain decoding
        # (K = 0), with the very same output. The next Propose resends each whole
        # sequence (valid_len 0), which rebuilds the draft's cache whatever it kept.
        log.warning("Propose failed (%s: %s); this round decodes without speculation", error.code().name, error.details())
        draft_error = error
        proposals = {}
        for seq in seqs:
            seq.draft_valid = 0
    proposed = time.perf_counter()
    logits = await verify(target, seqs, proposals)
    verified = time.perf_counter()
    results = await sampler.run(accept_all, seqs, logits, proposals)
    for seq in seqs:
        k = len(proposals[seq.slot_id].tokens) if seq.slot_id in proposals else 0
        ks[seq.slot_id] = k
        advance(seq, k, results[seq.slot_id].num_accepted[0])
        seq.emit(results[seq.slot_id].output_tokens[0], max_seq_len)
    return RoundReport(
        ks=ks,
        num_accepted={slot: r.num_accepted[0] for slot, r in results.items()},
        propose_s=proposed - started,
        verify_s=verified - proposed,
        draft_failed=draft_error is not None,
    )
