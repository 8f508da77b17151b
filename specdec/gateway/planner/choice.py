"""The planner's choice for the requests whose K is its to choose, and why a source is off.

Each round: the best uniform K of the model draft (each request capped), then a lookup instead
wherever that raises the batch's predicted rate, then K = 0 for any request whose own drafting
costs the batch more than it yields.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TypeVar

from specdec.gateway.draft_sources import DraftSource
from specdec.gateway.planner.lookups import take_lookups
from specdec.gateway.planner.rates import CatchUp, RatePredictor, SourceChoice
from specdec.gateway.planner.status import SwitchReason
from specdec.gateway.proposers import LookupDraft
from specdec.gateway.request import Request

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Why a round speculated less than it could, as exported in the metrics.
OFF_REASONS = ("not_paying", "batch", "draft_unavailable")
#: The search for the best uniform K stops this many K past the best drafting K so far: from
#: K = 1 on, the predicted rate rises to one peak and falls (tokens per round grow ever
#: slower, a round's cost linearly; a catch-up adds the same to every round), and every K
#: tried costs a rate prediction each round: trying all 17 took ~1.5 ms a round of a single
#: request, 2-4 % of its step (docs/performance.md#adaptive-k-planner-rules). K = 0 pays no
#: draft at all, so a catch-up can put K = 1-3 below it and K = 8 above.
SEARCH_PATIENCE = 3


def choose(
    rates: RatePredictor, choice: SourceChoice, flexible: list[Request], caps: dict[str, int],
    steps: dict[str, int], lookups: dict[str, LookupDraft], model_ok: set[str],
) -> str | None:
    """Set the flexible requests' K and source in `choice` (see the module docstring). Returns
    why some went off (one of `OFF_REASONS`), if any did."""
    for s in flexible:
        choice.set(s.slot_id, 0, lookup=False)
    plain_steps = [steps.get(s.slot_id, 1) for s in rates.seqs] if steps else None
    best_rate = best_model_k(rates, choice, [s for s in flexible if s.slot_id in model_ok], caps, plain_steps)
    best_rate = take_lookups(rates, choice, [s for s in flexible if s.slot_id in lookups], caps, lookups, best_rate)
    if all(choice.ks[s.slot_id] == 0 for s in flexible):
        return "not_paying" if len(rates.seqs) == 1 else "batch"
    off_reason = None
    for s in flexible:
        k, on_lookup = choice.ks[s.slot_id], s.slot_id in choice.on_lookup
        if k == 0:
            continue
        choice.set(s.slot_id, 0, lookup=False)
        rate = rates.rate(choice.ks, choice.on_lookup, plain_steps)
        if rate > best_rate:
            best_rate, off_reason = rate, "not_paying"
        else:
            choice.set(s.slot_id, k, lookup=on_lookup)
    return off_reason


def best_model_k(
    rates: RatePredictor, choice: SourceChoice, drafting: list[Request], caps: dict[str, int],
    plain_steps: list[int] | None,
) -> float:
    """Set the uniform K (each capped) of the model draft that maximises the batch's rate for
    the `drafting` requests (searched up to `SEARCH_PATIENCE` past the best); returns that rate."""
    best_rate, best_k = -1.0, 0
    peak_rate, peak_k = -1.0, 1  # the best drafting K: the search stops past it
    trace = []  # the rate of each K tried, for the debug log
    for k in range(max((caps[s.slot_id] for s in drafting), default=0) + 1):
        if k > peak_k + SEARCH_PATIENCE:
            break
        for s in drafting:
            choice.ks[s.slot_id] = min(k, caps[s.slot_id])
        rate = rates.rate(choice.ks, choice.on_lookup, plain_steps)
        trace.append(round(rate, 1))
        if rate > best_rate:
            best_rate, best_k = rate, k
        if k > 0 and rate > peak_rate:
            peak_rate, peak_k = rate, k
    for s in drafting:
        choice.ks[s.slot_id] = min(best_k, caps[s.slot_id])
    if log.isEnabledFor(logging.DEBUG):
        log.debug("plan: batch %d, best uniform K %d at %.1f tok/s (by K: %s), α_1 %s", len(rates.seqs), best_k,
                  best_rate, trace, [round(a[0], 2) for a in rates.alphas])
    return best_rate


def off_cause(source: DraftSource, rates: RatePredictor, choice: SourceChoice, candidates: list[Request],
              caps: dict[str, int]) -> SwitchReason:
    """Which estimate keeps `source` off for the `candidates`: even a draft that is always
    accepted and caught up does not pay (COST alone, LOAD where it would pay for the first
    candidate alone), or it would pay caught up (CATCH_UP), or only its acceptance is too low."""
    everyone = range(len(rates.seqs))
    if source is DraftSource.MODEL:
        ideal = replace(rates, alphas=[[1.0] for _ in everyone], catch_ups=[CatchUp() for _ in everyone])
    else:
        ideal = replace(rates, lookup_alphas=[[0.99] for _ in everyone])
    if not _would_pay(ideal, source, choice, candidates, caps):
        first = rates.seqs.index(candidates[0])
        alone = _alone(ideal, first)
        if len(rates.seqs) > 1 and _would_pay(alone, source, SourceChoice({candidates[0].slot_id: 0}),
                                              candidates[:1], caps):
            return SwitchReason.LOAD
        return SwitchReason.COST
    if source is DraftSource.MODEL:
        hopeful = replace(rates, alphas=[[1.0] for _ in everyone])
        if not _would_pay(hopeful, source, choice, candidates, caps):
            return SwitchReason.CATCH_UP
    return SwitchReason.ACCEPTANCE


def _alone(rates: RatePredictor, i: int) -> RatePredictor:
    """`rates` for request i alone in its batch."""
    def pick(values: list[T]) -> list[T]:
        return values[i:i + 1] if values else values
    return replace(rates, seqs=rates.seqs[i:i + 1], alphas=pick(rates.alphas), catch_ups=pick(rates.catch_ups),
                   feeds=pick(rates.feeds), lookup_alphas=pick(rates.lookup_alphas), guess_cuts=pick(rates.guess_cuts),
                   self_guesses=pick(rates.self_guesses))


def _would_pay(rates: RatePredictor, source: DraftSource, choice: SourceChoice, candidates: list[Request],
               caps: dict[str, int]) -> bool:
    """Whether drafting with `source` at some uniform K for the `candidates` beats the batch's
    rate with them plain, the rest as `choice` has them."""
    base = dict(choice.ks)
    on_lookup = set(choice.on_lookup) - {s.slot_id for s in candidates}
    for s in candidates:
        base[s.slot_id] = 0
    plain = rates.rate(base, on_lookup)
    lookup = source is not DraftSource.MODEL
    for k in range(1, max(caps[s.slot_id] for s in candidates) + 1):
        trial = {**base, **{s.slot_id: min(k, caps[s.slot_id]) for s in candidates}}
        if rates.rate(trial, on_lookup | ({s.slot_id for s in candidates} if lookup else set())) > plain:
            return True
    return False
