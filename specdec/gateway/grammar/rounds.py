"""A round of structured-output requests: where the grammar allows one continuation alone, it
starts the request's draft (`with_forced_tokens`); each verify row gets the grammar's mask, and a
draft is cut where the grammar refuses one of its tokens (`constrain`).

Cutting keeps the output exact: a greedy request, a seeded one (kept while it equals the
target's own draws) and a lookup's draft (q one-hot: a refused token is rejected for certain,
and the residual is then p itself) lose nothing by dropping the refused token and all after it.
A model draft judged by rejection sampling keeps the refused token (p = 0 there, so it is
rejected for certain, but the residual norm(max(p - q, 0)) it leads to is what keeps the
output's distribution p); only the tokens after it go, and its bonus row is never used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection

import torch

from specdec.gateway.draft_sources import DraftSource
from specdec.gateway.proposers import LookupDraft
from specdec.gateway.request import Request, Verification
from specdec.gateway.rounds import RoundPlan
from specdec.sampling.token_masks import TokenMasks
from specdec.wire.items import Proposal

#: Whether feeding this many forced tokens ahead of a k-token model draft pays in a batch of
#: this size (`CostEstimates.forced_prefix_pays`): (batch_size, forced, k) -> bool.
PrefixPays = Callable[[int, int, int], bool]


def with_forced_tokens(plan: RoundPlan, batch: list[Request], caps: dict[str, int],
                       prefix_pays: PrefixPays) -> RoundPlan:
    """`plan` with each structured-output request that the grammar forces on drafting the forced
    tokens first. They cost no draft step, and the target, whose p the mask makes certain of
    them, accepts them all. A request the model drafts for drafts that many tokens more (up to
    its cap) where the wider first draft forward pays (`prefix_pays`): its draft walks the same
    grammar, guesses them (in place of a lookup's guess) and draws them without a step each, so
    the planned K follow them. Any other (plain, drafting a lookup, or where the width does not
    pay) drafts the forced tokens alone (up to its cap), with no Propose. The round then drafts,
    so no request takes several plain steps in it."""
    forced, longer = {}, {}
    drafting = sum(1 for k in plan.model_ks.values() if k > 0)
    for seq in batch:
        slot, cap = seq.slot_id, caps[seq.slot_id]
        if seq.grammar is None or cap <= 0 or not (tokens := seq.grammar.forced_tokens()):
            continue
        if (k := plan.model_ks.get(slot, 0)) > 0 and prefix_pays(drafting, len(tokens), k):
            longer[slot] = min(cap, k + len(tokens))
        else:
            forced[slot] = LookupDraft(tuple(tokens[:cap]), DraftSource.GRAMMAR, len(tokens))
    if not forced and not longer:
        return plan
    return dataclasses.replace(
        plan, ks=plan.ks | longer | {slot: len(draft.tokens) for slot, draft in forced.items()}, steps={},
        lookups=plan.lookups | forced, guesses={s: g for s, g in plan.guesses.items() if s not in forced | longer},
        self_guessing=plan.self_guessing - set(forced),
    )


def first_masks(seqs: list[Request]) -> dict[str, TokenMasks]:
    """The one-row mask of each structured-output request's next token after a Prefill."""
    return {s.slot_id: s.grammar.masks_along([])[0] for s in seqs if s.grammar is not None}


def constrain(
    seqs: list[Request], proposals: dict[str, Proposal], lookups: Collection[str]
) -> tuple[dict[str, Proposal], dict[str, TokenMasks]]:
    """The round's proposals, cut where a grammar refuses a draft token (a request whose draft is
    cut to nothing decodes plainly), and the masks of each structured-output request's rows."""
    kept, masks = dict(proposals), {}
    for seq in seqs:
        if seq.grammar is None:
            continue
        proposal = proposals.get(seq.slot_id)
        drafted = proposal.tokens if proposal is not None else []
        rows, legal = seq.grammar.masks_along(drafted)
        if proposal is None or legal == len(drafted):
            masks[seq.slot_id] = rows
            continue
        if _keeps_refused(seq, seq.slot_id in lookups):
            # Its bonus row is never used (the refused token is rejected): any allowed set does.
            masks[seq.slot_id] = TokenMasks(torch.cat([rows.words, rows.words[-1:]]))
            kept[seq.slot_id] = _head(proposal, legal + 1)
        elif legal > 0:
            masks[seq.slot_id] = rows
            kept[seq.slot_id] = _head(proposal, legal)
        else:
            masks[seq.slot_id] = rows
            del kept[seq.slot_id]
    return kept, masks


def _keeps_refused(seq: Request, lookup: bool) -> bool:
    return not seq.sampling.is_greedy and seq.verification is Verification.REJECTION and not lookup


def _head(proposal: Proposal, k: int) -> Proposal:
    probs = proposal.probs.head(k) if proposal.probs is not None else None
    return dataclasses.replace(proposal, tokens=proposal.tokens[:k], probs=probs)
