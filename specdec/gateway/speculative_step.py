"""One speculation round, phase by phase: plan, propose, verify, accept, advance.

`run_round` reads top to bottom as the algorithm: the draft proposes K tokens per request
(one batched Propose, checking a lookup's guess where the plan gives one; a request whose plan
has a lookup alone takes its tokens from there instead),
the target scores [g, t1..tK] per request (one batched Verify),
the rejection sampler accepts a prefix and adds a recovered or bonus token, and each
sequence's valid cache lengths move forward — which is the implicit rollback of both
caches on the next round.
"""

from __future__ import annotations

import logging
import time
import typing
from collections.abc import Collection

import grpc

from specdec.errors import InvalidArgumentError, ServiceStateError
from specdec.gateway.acceptance import accept_all
from specdec.gateway.deadlines import Deadlines
from specdec.gateway.grammar.rounds import constrain
from specdec.gateway.kv_handoff import KVHandoff, hand_off
from specdec.gateway.model_clients import DraftAPI, TargetAPI, Timed
from specdec.gateway.pools import refused_for_room
from specdec.gateway.proposers import LookupDraft
from specdec.gateway.request import Request, Verification
from specdec.gateway.rounds import ProposeOutcome, RoundPlan, RoundReport
from specdec.gateway.token_logprobs import round_logprobs
from specdec.sampling.logprobs import TokenLogprob
from specdec.sampling.sparse_probs import SparseRows
from specdec.sampling.token_masks import TokenMasks
from specdec.serving.serial_executor import SerialExecutor
from specdec.wire.items import (
    ArgmaxMode,
    DecodeMode,
    DraftGrammar,
    DrawnMode,
    LogitsMode,
    Proposal,
    ProposeItem,
    SampledMode,
    VerifiedChunk,
    VerifiedDecode,
    VerifyItem,
    VerifyMode,
)

log = logging.getLogger(__name__)


def plan_k(seq: Request, max_seq_len: int) -> int:
    """Draft length for this round: the request's K, shrunk so that the K+1 tokens a round
    may emit fit both max_seq_len and max_new_tokens (0 = plain decoding)."""
    room = min(max_seq_len - len(seq.tokens), seq.max_new_tokens - seq.completion_tokens) - 1
    return max(0, min(seq.num_speculative_tokens, room))


def plan_steps(seq: Request, max_seq_len: int, limit: int) -> int:
    """Tokens a plain round may decode for this request in one Verify (multi-step plain
    decoding, the target choosing each token and feeding it on): up to `limit`, never more
    than the request may still emit."""
    if limit <= 1:
        return 1
    room = min(max_seq_len - len(seq.tokens), seq.max_new_tokens - seq.completion_tokens)
    return max(1, min(limit, room))


async def propose(
    draft: DraftAPI | None, seqs: list[Request], ks: dict[str, int], deadlines: Deadlines,
    guesses: dict[str, LookupDraft] | None = None, self_guessing: Collection[str] = (), grammar_guesses: bool = True,
) -> Timed[dict[str, Proposal]]:
    """One batched Propose for every sequence with K >= 1, with its lookup guess if it has one,
    letting the draft guess on its own for those in `self_guessing`; a structured-output request's
    grammar goes with it (the draft masks its draws, and guesses the forced tokens where
    `grammar_guesses`)."""
    speculating = [s for s in seqs if ks[s.slot_id] > 0]
    if not speculating:
        return Timed({}, 0.0, 0.0)
    if draft is None:
        raise RuntimeError("K > 0 was planned without a draft service")
    guesses = guesses or {}
    for seq in speculating:
        seq.has_draft_slot = True  # from now on the draft may hold a slot: release it at the end
    items = [ProposeItem(s.slot_id, s.draft_valid, s.tokens[s.draft_valid :], ks[s.slot_id], s.draft_sampling,
                         list(guess.tokens) if (guess := guesses.get(s.slot_id)) is not None else [],
                         s.slot_id in self_guessing, s.stop_token_ids, _draft_grammar(s, grammar_guesses),
                         s.declared_len)
             for s in speculating]
    timeout = deadlines.propose(
        len(items), max(len(i.new_tokens) + len(i.guess_tokens) for i in items),
        max(i.num_speculative_tokens for i in items),
    )
    proposed = await draft.propose(items, timeout)
    for item in items:
        proposal = proposed.value[item.slot_id]
        _check_drafted(item, proposal.tokens)
        # The draft caches the valid prefix, the new tokens and all but the last drafted token.
        _check_cached("draft", item.slot_id, proposal.cached_len,
                      item.valid_len + len(item.new_tokens) + len(proposal.tokens) - 1)
        if not item.sampling.is_greedy:
            _check_q(proposal)
    return proposed


def _draft_grammar(seq: Request, forced_guesses: bool) -> DraftGrammar | None:
    """The request's grammar as the draft walks it: from the answer's first token on."""
    if seq.grammar is None:
        return None
    return DraftGrammar(seq.grammar.text, len(seq.prompt), forced_guesses)


def _check_drafted(item: ProposeItem, tokens: list[int]) -> None:
    """The draft drafts K tokens, or fewer ending at a stop token; anything else means it
    did not do what it was asked, and its tokens cannot be trusted."""
    k = len(tokens)
    if k == item.num_speculative_tokens or (0 < k < item.num_speculative_tokens and tokens[-1] in item.stop_token_ids):
        return
    raise ServiceStateError(f"the draft sent {k} tokens for slot {item.slot_id}, the gateway asked for "
                            f"{item.num_speculative_tokens} (fewer only up to a stop token)")


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
    target: TargetAPI, seqs: list[Request], proposals: dict[str, Proposal], plan: RoundPlan, deadlines: Deadlines,
    masks: dict[str, TokenMasks] | None = None,
) -> Timed[dict[str, VerifiedChunk]]:
    """One batched Verify of [pending tokens, t1..tK] after each sequence's valid prefix, each
    item in the mode its request needs (`verify_mode`), with its grammar's `masks` if it has one."""
    masks = masks or {}
    items = [verify_item(s, proposals.get(s.slot_id), plan, masks.get(s.slot_id)) for s in seqs]
    timeout = deadlines.verify(len(items), max(len(i.tokens) for i in items), max(plan.steps.values(), default=1))
    verified = await target.verify(items, timeout)
    for item in items:
        result = verified.value[item.slot_id]
        if not isinstance(item.mode, DecodeMode):
            _check_cached("target", item.slot_id, result.cached_len, item.cached_len_after)
            continue
        # The target may stop a Decode item early near the call's deadline: 1..n tokens,
        # of which it cached the pending token and all but the last.
        decoded = len(result.tokens) if isinstance(result, VerifiedDecode) else 0
        if not 1 <= decoded <= item.mode.steps:
            raise ServiceStateError(f"the target sent {decoded} decoded tokens for slot {item.slot_id}, "
                                    f"the gateway asked for {item.mode.steps}")
        _check_cached("target", item.slot_id, result.cached_len, item.valid_len + decoded)
    return verified


def verify_item(seq: Request, proposal: Proposal | None, plan: RoundPlan,
                masks: TokenMasks | None = None) -> VerifyItem:
    """The tokens the target has not cached yet (the pending token g), then the draft's."""
    drafted = proposal.tokens if proposal is not None else []
    return VerifyItem(seq.slot_id, seq.target_valid, seq.tokens[seq.target_valid :] + drafted,
                      verify_mode(seq, proposal, plan), masks)


def verify_mode(seq: Request, proposal: Proposal | None, plan: RoundPlan) -> VerifyMode:
    """How the target answers `seq`: a request without a proposal decodes plainly on the
    target; a drafting one is judged here from the argmax (greedy, untransformed), the logits
    (greedy with a logit bias or a penalty), the target's own draws (sampled and seeded: the tokens plain
    decoding draws, so the output does not depend on what was drafted) or its candidates
    (sampled, unseeded: rejection sampling, which keeps more draft tokens)."""
    raw_argmax = seq.sampling.greedy_by_raw_argmax
    if proposal is None:
        # A grammar's mask covers one step: the gateway moves the grammar past each token.
        steps = 1 if seq.grammar is not None else plan.steps_of(seq.slot_id)
        return DecodeMode(steps, None if raw_argmax else seq.target_sampling, seq.logprobs)
    if raw_argmax:
        return ArgmaxMode(seq.logprobs)
    if seq.sampling.is_greedy:
        return LogitsMode()  # logprobs, if asked, come from these logits (`token_logprobs`)
    if seq.verification is Verification.DRAWN:
        return DrawnMode(seq.target_sampling, seq.logprobs)
    if proposal.probs is None:
        raise ServiceStateError(f"the draft sent no q for the sampled slot {seq.slot_id}")
    return SampledMode(seq.target_sampling, proposal.probs, seq.logprobs)


def _check_cached(service: str, slot_id: str, cached_len: int, expected: int) -> None:
    """A service's cache must hold exactly what the gateway's bookkeeping says it sent:
    anything else means one side lost track, and continuing would emit wrong tokens."""
    if cached_len != expected:
        raise ServiceStateError(
            f"the {service} holds {cached_len} tokens for slot {slot_id}, the gateway expected {expected}"
        )


def advance_steps(seq: Request, steps: int) -> None:
    """After a multi-step plain round: the target cached the pending token and all but the
    last of the `steps` tokens it decoded (before emitting them)."""
    seq.target_valid = len(seq.tokens) + steps - 1


def advance(seq: Request, k: int, num_accepted: int) -> None:
    """Move the valid cache lengths past the accepted tokens (before emitting them).

    The target cached [pending..., t1..tK]: everything up to t_n is valid. The draft cached
    the sequence plus t1..t_{K-1} (the last draft token is never fed back).
    """
    length = len(seq.tokens)
    seq.target_valid = length + num_accepted
    if k > 0:
        seq.draft_valid = length + min(num_accepted, k - 1)


async def run_round(
    target: TargetAPI, draft: DraftAPI | None, seqs: list[Request], plan: RoundPlan, sampler: SerialExecutor,
    max_seq_len: int, deadlines: Deadlines, handoff: KVHandoff | None = None,
) -> RoundReport:
    """Fill the draft's cache from the target's where the plan says (`handoff`), then propose,
    verify, accept and advance every sequence by one round as `plan` says. A request without
    a proposal (K = 0, or the draft failed) decodes plainly on the target: nothing comes back
    to judge, and the plan's `steps` tokens share one call."""
    started = time.perf_counter()
    handed = {}
    if plan.handoffs and handoff is not None and draft is not None:
        handed = await hand_off(target, draft, [s for s in seqs if s.slot_id in plan.handoffs], handoff, deadlines)
    proposed, propose_outcome = await propose_or_plain(draft, seqs, plan, deadlines)
    proposals: dict[str, Proposal] = proposed.value | lookup_proposals(seqs, plan)
    masks: dict[str, TokenMasks] = {}
    if any(s.grammar is not None for s in seqs):  # grammar walks take ms: off the event loop
        proposals, masks = await sampler.run(constrain, seqs, proposals, plan.lookups)
    verified = await verify(target, seqs, proposals, plan, deadlines, masks)
    accept_started = time.perf_counter()
    drafting = [s for s in seqs if s.slot_id in proposals]
    accepted = await sampler.run(accept_all, drafting, verified.value, proposals, masks) if drafting else {}
    accept_s = time.perf_counter() - accept_started
    logprobs = (await sampler.run(round_logprobs, seqs, proposals, verified.value, accepted, masks)
                if any(s.logprobs is not None for s in seqs) else {})
    ks, num_accepted, steps = advance_all(seqs, proposals, verified.value, accepted, max_seq_len, plan.lookups,
                                          logprobs)
    guessed = {slot: p.saved_steps for slot, p in proposed.value.items() if p.saved_steps}
    sources = {slot: source for slot in ks if ks[slot] and (source := plan.source_of(slot, slot in guessed))}
    return RoundReport(
        ks, num_accepted, propose=proposed.costs(), verify=verified.costs(), accept_s=accept_s,
        total_s=time.perf_counter() - started, propose_outcome=propose_outcome, steps=steps, sources=sources,
        guessed=guessed,
        own_guess_tokens={slot: p.own_guess_tokens for slot, p in proposed.value.items() if p.own_guess_tokens},
        forced={slot: (p.forced_steps, p.forced_tokens) for slot, p in proposed.value.items() if p.forced_tokens},
        handoffs=handed,
    )


def lookup_proposals(seqs: list[Request], plan: RoundPlan) -> dict[str, Proposal]:
    """The plan's lookup drafts as proposals: a sampled request's q is one-hot on each token (a
    deterministic draft), a greedy one needs none. The draft model's cache is not involved."""
    out = {}
    for seq in seqs:
        lookup = plan.lookups.get(seq.slot_id)
        if lookup is not None:
            probs = None if seq.sampling.is_greedy else SparseRows.one_hot(lookup.tokens)
            out[seq.slot_id] = Proposal(seq.slot_id, list(lookup.tokens), probs, seq.draft_valid)
    return out


def advance_all(
    seqs: list[Request], proposals: dict[str, Proposal], verified: dict[str, VerifiedChunk],
    accepted: dict[str, list[int]], max_seq_len: int, lookups: Collection[str] = (),
    logprobs: dict[str, list[TokenLogprob]] | None = None,
) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Advance every sequence past its new tokens and emit them (with their `logprobs`, for the
    requests that asked): a drafting request's `accepted` tokens (its accepted draft tokens, then
    one recovered or bonus token), a plain one's decoded tokens. Returns per slot the K drafted,
    the tokens accepted and the tokens decoded plainly (1 for a drafting request). The draft
    model's cache moves only for the requests it drafted for (not in `lookups`)."""
    logprobs = logprobs or {}
    ks, num_accepted, steps = {}, {}, {}
    for seq in seqs:
        slot = seq.slot_id
        if slot in accepted:
            ks[slot], num_accepted[slot], steps[slot] = len(proposals[slot].tokens), len(accepted[slot]) - 1, 1
            advance(seq, 0 if slot in lookups else ks[slot], num_accepted[slot])
            seq.emit(accepted[slot], max_seq_len, logprobs.get(slot))
        else:
            tokens = typing.cast(VerifiedDecode, verified[slot]).tokens  # `verify` checked the kind
            ks[slot], num_accepted[slot], steps[slot] = 0, 0, len(tokens)
            advance_steps(seq, len(tokens))
            seq.emit(tokens, max_seq_len, logprobs.get(slot))
    return ks, num_accepted, steps


async def propose_or_plain(
    draft: DraftAPI | None, seqs: list[Request], plan: RoundPlan, deadlines: Deadlines
) -> tuple[Timed[dict[str, Proposal]], ProposeOutcome]:
    """The round's proposals, and how Propose went: the draft only ever speeds things up, so
    without it the round is plain decoding (no proposals), with the very same output. After a
    failure the next Propose resends each whole sequence (valid_len 0), which rebuilds the
    draft's cache whatever it kept; after a refusal for room each slot still holds its valid
    prefix (`draft_valid` stands: the draft only rolls back to it and appends)."""
    started = time.perf_counter()
    try:
        return await propose(draft, seqs, plan.model_ks, deadlines, plan.guesses, plan.self_guessing,
                             plan.grammar_drafts), ProposeOutcome.ANSWERED
    except (grpc.aio.AioRpcError, ServiceStateError) as error:
        failed: Timed[dict[str, Proposal]] = Timed({}, 0.0, time.perf_counter() - started)
        if refused_for_room(error):
            return failed, ProposeOutcome.NO_ROOM
        reason = f"{error.code().name}: {error.details()}" if isinstance(error, grpc.aio.AioRpcError) else str(error)
        log.warning("Propose failed (%s); this round decodes without speculation", reason)
        for seq in seqs:
            seq.draft_valid = 0
        return failed, ProposeOutcome.FAILED
