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
from dataclasses import dataclass, field

import grpc
import torch

from specdec.errors import InvalidArgumentError, ServiceStateError
from specdec.gateway.deadlines import Deadlines
from specdec.gateway.model_clients import DraftAPI, TargetAPI, Timed
from specdec.gateway.sequence import Sequence
from specdec.sampling.rejection_sampler import (
    RejectionResult,
    accept_candidates,
    greedy_accept,
    greedy_accept_argmax,
)
from specdec.sampling.transforms import chunk_apply_repetition_penalty, logits_to_probs, sample
from specdec.serving.worker import ModelWorker
from specdec.wire.items import Proposal, ProposeItem, VerifiedChunk, VerifyItem

log = logging.getLogger(__name__)


def plan_k(seq: Sequence, max_seq_len: int) -> int:
    """Draft length for this round: the request's K, shrunk so that the K+1 tokens a round
    may emit fit both max_seq_len and max_new_tokens (0 = plain decoding)."""
    room = min(max_seq_len - len(seq.tokens), seq.max_new_tokens - seq.completion_tokens) - 1
    return max(0, min(seq.num_speculative_tokens, room))


def plan_steps(seq: Sequence, max_seq_len: int, limit: int) -> int:
    """Tokens a plain round may decode for this request in one Verify (multi-step plain
    decoding, the target choosing each token and feeding it on): up to `limit`, never more
    than the request may still emit."""
    if limit <= 1:
        return 1
    room = min(max_seq_len - len(seq.tokens), seq.max_new_tokens - seq.completion_tokens)
    return max(1, min(limit, room))


async def propose(
    draft: DraftAPI | None, seqs: list[Sequence], ks: dict[str, int], deadlines: Deadlines
) -> Timed[dict[str, Proposal]]:
    """One batched Propose for every sequence with K >= 1."""
    speculating = [s for s in seqs if ks[s.slot_id] > 0]
    if not speculating:
        return Timed({}, 0.0, 0.0)
    if draft is None:
        raise RuntimeError("K > 0 was planned without a draft service")
    for seq in speculating:
        seq.has_draft_slot = True  # from now on the draft may hold a slot: release it at the end
    items = [ProposeItem(s.slot_id, s.draft_valid, s.tokens[s.draft_valid :], ks[s.slot_id], s.draft_sampling)
             for s in speculating]
    timeout = deadlines.propose(
        len(items), max(len(i.new_tokens) for i in items), max(i.num_speculative_tokens for i in items)
    )
    proposed = await draft.propose(items, timeout)
    for item in items:
        # The draft caches the valid prefix, the new tokens and all but the last drafted token.
        _check_cached("draft", item.slot_id, proposed.value[item.slot_id].cached_len,
                      item.valid_len + len(item.new_tokens) + item.num_speculative_tokens - 1)
        if not item.sampling.is_greedy:
            _check_q(proposed.value[item.slot_id])
    return proposed


#: The token ids of a q row are checked against the vocabulary by the target; here only
#: their range on the wire (int32).
_WIRE_ID_LIMIT = 2**31


def _check_q(proposal: Proposal) -> None:
    """A sampled request's q must be one well-formed row per drafted token that gives the token
    a chance. The target would refuse the Verify otherwise, and the requests would fail with
    it; a bad Propose only costs speculation (the round runs plain)."""
    if proposal.probs is None:
        raise ServiceStateError(f"the draft sent no q for the sampled slot {proposal.slot_id}")
    try:
        proposal.probs.check_drafted(proposal.tokens, _WIRE_ID_LIMIT, "probs")
    except InvalidArgumentError as error:
        raise ServiceStateError(f"the draft sent a malformed q for slot {proposal.slot_id}: {error}") from None


async def verify(
    target: TargetAPI, seqs: list[Sequence], proposals: dict[str, Proposal], deadlines: Deadlines,
    steps: dict[str, int] | None = None,
) -> Timed[dict[str, VerifiedChunk]]:
    """One batched Verify: [pending tokens, t1..tK] after each sequence's valid prefix.
    Returns per slot the logits [K+1, vocab] of a greedy request with a repetition penalty,
    only their argmax [K+1] for a greedy request whose logits need no transform, and for a
    sampled request the K+1 candidates and p_i(t_i) that `accept_all` needs (the target draws
    them with its `target_sampling`). A request in `steps` (plain rounds) has the target
    decode its n tokens by itself: the argmax of the raw logits, or, with any transform or a
    temperature, the choice of its `target_sampling`."""
    steps = steps or {}
    items = [_verify_item(s, proposals, steps.get(s.slot_id)) for s in seqs]
    timeout = deadlines.verify(len(items), max(len(i.tokens) for i in items), max(i.decode_steps for i in items))
    verified = await target.verify(items, timeout)
    for item in items:
        result = verified.value[item.slot_id]
        if item.slot_id not in steps:
            _check_cached("target", item.slot_id, result.cached_len, item.cached_len_after)
            continue
        # The target may stop a multi-step item early near the call's deadline: 1..n tokens,
        # of which it cached the pending token and all but the last.
        decoded = len(result.chosen or [])
        if not 1 <= decoded <= item.decode_steps:
            raise ServiceStateError(f"the target sent {decoded} tokens for slot {item.slot_id}, "
                                    f"the gateway asked for {item.decode_steps}")
        _check_cached("target", item.slot_id, result.cached_len, item.valid_len + decoded)
    return verified


def _verify_item(seq: Sequence, proposals: dict[str, Proposal], steps: int | None) -> VerifyItem:
    """The Verify item of one sequence; `steps` set: a plain item whose tokens the target decodes."""
    proposal = proposals.get(seq.slot_id)
    tokens = seq.tokens[seq.target_valid :] + (proposal.tokens if proposal is not None else [])
    raw_argmax = seq.sampling.greedy_by_raw_argmax
    if steps is None:
        if not seq.sampling.is_greedy:
            return VerifyItem(seq.slot_id, seq.target_valid, tokens, sampling=seq.target_sampling,
                              draft_probs=proposal.probs if proposal is not None else None)
        return VerifyItem(seq.slot_id, seq.target_valid, tokens, argmax_only=raw_argmax)
    sampling = None if raw_argmax else seq.target_sampling
    return VerifyItem(seq.slot_id, seq.target_valid, tokens, argmax_only=raw_argmax, decode_steps=steps, sampling=sampling)


def _check_cached(service: str, slot_id: str, cached_len: int, expected: int) -> None:
    """A service's cache must hold exactly what the gateway's bookkeeping says it sent:
    anything else means one side lost track, and continuing would emit wrong tokens."""
    if cached_len != expected:
        raise ServiceStateError(
            f"the {service} holds {cached_len} tokens for slot {slot_id}, the gateway expected {expected}"
        )


PAD_TOKEN_ID = -1  # marks positions past a request's K in the padded [batch, K_max] tensors


def _padded_drafts(seqs: list[Sequence], proposals: dict[str, Proposal]) -> tuple[torch.Tensor, list[int], list[list[int]]]:
    """Draft tokens [B, K_max] (PAD_TOKEN_ID past each row's K), the K of each row and each
    row's drafted tokens as lists."""
    drafted = [proposals[s.slot_id].tokens if s.slot_id in proposals else [] for s in seqs]
    ks = [len(d) for d in drafted]
    k_max = max(ks)
    tokens = torch.tensor([d + [PAD_TOKEN_ID] * (k_max - len(d)) for d in drafted], dtype=torch.long)
    return tokens.view(len(seqs), k_max), ks, drafted


def _padded_round(
    seqs: list[Sequence], verified: dict[str, VerifiedChunk], proposals: dict[str, Proposal]
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[list[int]]]:
    """Stack the sequences' verify logits and draft tokens into batch tensors.

    Returns logits [B, K_max+1, vocab] and the `_padded_drafts`.
    """
    tokens, ks, drafted = _padded_drafts(seqs, proposals)  # tokens: [B, K_max]
    rows = [_logits_of(verified[s.slot_id]) for s in seqs]  # [K_b+1, vocab] each
    stacked = rows[0].new_zeros(len(seqs), tokens.shape[1] + 1, rows[0].shape[-1])  # [B, K_max+1, vocab]
    for b, row in enumerate(rows):
        stacked[b, : row.shape[0]] = row
    return stacked, tokens, ks, drafted


def _padded_chosen(
    seqs: list[Sequence], verified: dict[str, VerifiedChunk], proposals: dict[str, Proposal]
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The tokens the target chose per position [B, K_max+1] (argmax tokens, or a sampled
    request's candidates; PAD_TOKEN_ID past each row's K+1) and the `_padded_drafts` tokens
    [B, K_max] and Ks."""
    tokens, ks, _ = _padded_drafts(seqs, proposals)
    width = tokens.shape[1] + 1
    best = [verified[s.slot_id].chosen or [] for s in seqs]
    for s, k, row in zip(seqs, ks, best):
        if len(row) != k + 1:
            raise ServiceStateError(f"the target sent {len(row)} chosen tokens for slot {s.slot_id}, the gateway expected {k + 1}")
    target = torch.tensor([row + [PAD_TOKEN_ID] * (width - len(row)) for row in best], dtype=torch.long)
    return target.view(len(seqs), width), tokens, ks


def _padded_probs(seqs: list[Sequence], verified: dict[str, VerifiedChunk], proposals: dict[str, Proposal], ks: list[int]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampled round's p_i(t_i) (from the target) and q_i(t_i) (from the draft's q), each
    [B, K_max], 1.0 past each row's K (never judged)."""
    k_max = max(ks, default=0)
    p = torch.ones(len(seqs), k_max)  # [B, K_max]
    q = torch.ones(len(seqs), k_max)  # [B, K_max]
    for b, (seq, k) in enumerate(zip(seqs, ks)):
        if k == 0:
            continue
        target_probs, proposal = verified[seq.slot_id].target_probs or [], proposals[seq.slot_id]
        if len(target_probs) != k or proposal.probs is None:
            raise ServiceStateError(f"the target sent {len(target_probs)} probabilities for slot {seq.slot_id}, "
                                    f"the gateway expected {k}")
        p[b, :k] = torch.tensor(target_probs)
        q[b, :k] = proposal.probs.probs_of(proposal.tokens)
    return p, q


def _logits_of(chunk: VerifiedChunk) -> torch.Tensor:
    if chunk.logits is None:
        raise ServiceStateError(f"the target sent argmax tokens for slot {chunk.slot_id}, where the gateway asked for logits")
    return chunk.logits


def accept_all(
    seqs: list[Sequence], verified: dict[str, VerifiedChunk], proposals: dict[str, Proposal]
) -> dict[str, RejectionResult]:
    """Accept a prefix of each draft and add one recovered or bonus token, for the whole round.

    One `greedy_accept_argmax` call for the greedy requests the target sent argmax tokens
    for, one `greedy_accept` call for the other greedy ones (the repetition penalty applied
    here, its context growing through the draft tokens) and one `accept_candidates` call for
    the sampled ones, whose candidates and p_i(t_i) the target drew and computed with the
    same transforms and context. Pure tensor work: it runs on the gateway's sampler thread.
    """
    results: dict[str, RejectionResult] = {}
    by_argmax = [s for s in seqs if s.sampling.is_greedy and verified[s.slot_id].chosen is not None]
    greedy = [s for s in seqs if s.sampling.is_greedy and verified[s.slot_id].chosen is None]
    sampled = [s for s in seqs if not s.sampling.is_greedy]
    if by_argmax:
        best, tokens, ks = _padded_chosen(by_argmax, verified, proposals)  # [A, K+1], [A, K]
        results.update(_split(by_argmax, greedy_accept_argmax(best, tokens, ks)))
    if greedy:
        scores, tokens, ks, drafted = _padded_round(greedy, verified, proposals)  # [G, K+1, vocab], [G, K]
        scores = scores.float()
        penalties = [s.sampling.repetition_penalty for s in greedy]
        if any(p != 1.0 for p in penalties):
            scores = chunk_apply_repetition_penalty(scores, [s.tokens for s in greedy], drafted, penalties)
        batch = greedy_accept(scores, tokens, ks)
        results.update(_split(greedy, batch))
    if sampled:
        candidates, tokens, ks = _padded_chosen(sampled, verified, proposals)  # [S, K+1], [S, K]
        p, q = _padded_probs(sampled, verified, proposals, ks)  # [S, K] each
        batch = accept_candidates(p, q, tokens, ks, candidates, [s.generator for s in sampled])
        results.update(_split(sampled, batch))
    return results


def _split(seqs: list[Sequence], batch: RejectionResult) -> dict[str, RejectionResult]:
    return {
        s.slot_id: RejectionResult([batch.output_tokens[b]], [batch.num_accepted[b]]) for b, s in enumerate(seqs)
    }


def advance_steps(seq: Sequence, steps: int) -> None:
    """After a multi-step plain round: the target cached the pending token and all but the
    last of the `steps` tokens it decoded (before emitting them)."""
    seq.target_valid = len(seq.tokens) + steps - 1


def advance(seq: Sequence, k: int, num_accepted: int) -> None:
    """Move the valid cache lengths past the accepted tokens (before emitting them).

    The target cached [pending..., t1..tK]: everything up to t_n is valid. The draft cached
    the sequence plus t1..t_{K-1} (the last draft token is never fed back).
    """
    length = len(seq.tokens)
    seq.target_valid = length + num_accepted
    if k > 0:
        seq.draft_valid = length + min(num_accepted, k - 1)


def first_tokens(seqs: list[Sequence], logits: dict[str, torch.Tensor]) -> dict[str, int]:
    """The next token of each newly prefilled sequence, from its last-position logits: the first
    completion token, or, for a request resuming after a preemption, the one after its tokens
    (whose repetition-penalty context is all of them)."""
    out = {}
    for seq in seqs:
        probs = logits_to_probs(logits[seq.slot_id][None], [seq.sampling], [seq.tokens])  # [1, vocab]
        out[seq.slot_id] = int(probs.argmax()) if seq.sampling.is_greedy else int(sample(probs, [seq.generator])[0])
    return out


@dataclass(frozen=True)
class RoundReport:
    """What one round did, for statistics and the K planner: K and accepted count per slot,
    and where the round's time went."""

    ks: dict[str, int]
    num_accepted: dict[str, int]
    #: Propose and Verify: compute inside the service, and wall time seen by the gateway.
    propose: Timed[None]
    verify: Timed[None]
    #: The gateway's acceptance step (rejection sampling / greedy matching) for the batch.
    accept_s: float
    #: The whole round, wall clock.
    total_s: float
    #: Propose failed and the round ran as plain decoding.
    draft_failed: bool = False
    #: Tokens the target decoded per slot in a multi-step plain round (1 in any other round).
    steps: dict[str, int] = field(default_factory=dict)

    def phases(self) -> dict[str, float]:
        """The round's wall time split by `ROUND_PHASES`."""
        rpc = self.propose.wall_s - self.propose.compute_s + self.verify.wall_s - self.verify.compute_s
        counted = self.propose.compute_s + self.verify.compute_s + max(0.0, rpc) + self.accept_s
        return {
            "draft_compute": self.propose.compute_s,
            "verify_compute": self.verify.compute_s,
            "rpc": max(0.0, rpc),
            "accept": self.accept_s,
            "other": max(0.0, self.total_s - counted),
        }

    @property
    def overhead_s(self) -> float:
        """Round time spent outside both services' compute: RPCs, (de)serialisation, acceptance."""
        return max(0.0, self.total_s - self.propose.compute_s - self.verify.compute_s)


async def run_round(
    target: TargetAPI, draft: DraftAPI | None, seqs: list[Sequence], ks: dict[str, int], sampler: ModelWorker,
    max_seq_len: int, deadlines: Deadlines, steps: dict[str, int] | None = None,
) -> RoundReport:
    """Propose, verify, accept and advance every sequence by one round with the planned `ks`.
    In a plain round (every K 0) `steps` may give requests n >= 1 tokens that the target
    decodes by itself: nothing comes back to judge, and n tokens share one call."""
    steps = steps or {}
    if steps and any(ks.values()):
        raise ValueError("multi-step decoding is for plain rounds: every K must be 0")
    started = time.perf_counter()
    draft_error = None
    try:
        proposed = await propose(draft, seqs, ks, deadlines)
    except (grpc.aio.AioRpcError, ServiceStateError) as error:
        # The draft only ever speeds things up: without it the round is plain decoding
        # (K = 0), with the very same output. The next Propose resends each whole
        # sequence (valid_len 0), which rebuilds the draft's cache whatever it kept.
        reason = f"{error.code().name}: {error.details()}" if isinstance(error, grpc.aio.AioRpcError) else str(error)
        log.warning("Propose failed (%s); this round decodes without speculation", reason)
        draft_error = error
        proposed = Timed({}, 0.0, time.perf_counter() - started)
        for seq in seqs:
            seq.draft_valid = 0
    proposals = proposed.value
    verified = await verify(target, seqs, proposals, deadlines, steps)
    accept_started = time.perf_counter()
    judged = [s for s in seqs if s.slot_id not in steps]  # the target decoded the others by itself
    results = await sampler.run(accept_all, judged, verified.value, proposals) if judged else {}
    accept_s = time.perf_counter() - accept_started
    done = {}
    decoded: dict[str, int] = {}
    for seq in seqs:
        if seq.slot_id in steps:
            tokens = verified.value[seq.slot_id].chosen or []
            done[seq.slot_id], decoded[seq.slot_id] = 0, len(tokens)
            advance_steps(seq, len(tokens))
            seq.emit(tokens, max_seq_len)
            continue
        k = len(proposals[seq.slot_id].tokens) if seq.slot_id in proposals else 0
        done[seq.slot_id] = k
        advance(seq, k, results[seq.slot_id].num_accepted[0])
        seq.emit(results[seq.slot_id].output_tokens[0], max_seq_len)
    return RoundReport(
        ks=done,
        num_accepted={slot: results[slot].num_accepted[0] if slot in results else 0 for slot in done},
        propose=Timed(None, proposed.compute_s, proposed.wall_s),
        verify=Timed(None, verified.compute_s, verified.wall_s),
        accept_s=accept_s,
        total_s=time.perf_counter() - started,
        draft_failed=draft_error is not None,
        steps={slot: decoded.get(slot, 1) for slot in done},
    )
