"""What it costs to bring the draft up to a request it has not seen, and when to pay it.

A prompt the draft never saw (or everything decoded while speculation was off) is a one-off
draft forward that only a long enough future of speculating repays (`CatchUp.per_round`
spreads it). Where the target's cache can fill the draft's (`kv_handoff`), the catch-up is that
copy where it is the cheaper of the two as measured (`hands_off`). A request that may also look
up waits before paying a long prompt's catch-up (`renting`): its first rounds show whether its
answer copies or ends soon.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from specdec.cost_model import CostTable, RoundCostModel
from specdec.gateway.kv_handoff import HandoffCost, KVHandoff
from specdec.gateway.planner.costs import CostEstimates, catch_up_class
from specdec.gateway.planner.rates import CatchUp, RatePredictor, SourceChoice
from specdec.gateway.request import Request
from specdec.gateway.rounds import RoundPlan, RoundReport

log = logging.getLogger(__name__)

#: The most tokens a round leaves for the draft to feed: the last draft token and the bonus
#: token after a fully accepted round. More (a prompt, tokens decoded while speculation was
#: off) is a catch-up.
MAX_ROUND_FEED = 2
#: A draft catch-up dearer than this many plain rounds waits until waiting has cost its
#: request as much (`CatchUpPricer.renting`). Waiting costs only the saving it forgoes, so it
#: lasts several times the catch-up's rounds: a chat prompt's catch-up of a few rounds is cheaper bought.
RENT_FROM_ROUNDS = 8


def round_feed(seq: Request) -> int:
    """Tokens the draft's first step takes for `seq`: the 1-2 it has not seen after a round, or
    1 when it must catch up on more (`CatchUpPricer.catch_up` prices the rest)."""
    pending = seq.draft_pending
    return pending if 1 <= pending <= MAX_ROUND_FEED else 1


def catch_up_forward(seq: Request, draft: CostTable) -> tuple[float, float]:
    """The table's seconds for the forward that feeds the draft what it has not seen of `seq`:
    up to its widest measured chunk, and the rest. Its queries read only the context the draft
    holds (a prompt's catch-up reads nothing but itself). Past the widest chunk the table
    extends a line, but a chunk reads more of itself the wider it is (attention grows with its
    square), hence the catch-up scales, one per length class."""
    held = draft.at_context(max(float(seq.draft_valid), float(draft.base_context)))
    pending = max(seq.draft_pending, 1)
    within = held.seconds(1, min(pending, draft.widest_chunk))
    return within, held.seconds(1, pending) - within


@dataclass
class CatchUpPricer:
    costs: CostEstimates
    #: How the target's cache fills the draft's (None: the draft catches up by itself).
    kv_handoff: KVHandoff | None = None
    handoff_cost: HandoffCost = field(default_factory=HandoffCost)
    #: Seconds of the rounds each request spent waiting to pay its draft's catch-up (`renting`).
    rent: dict[str, float] = field(default_factory=dict)

    def catch_up(self, seq: Request, model: RoundCostModel) -> CatchUp:
        """What feeding the draft the tokens it has not seen costs beyond a normal step."""
        if model.draft is None or seq.draft_pending <= MAX_ROUND_FEED:
            return CatchUp()
        extra = self.seconds(seq) - model.draft.step(1)
        return CatchUp(max(0.0, extra), seq.max_new_tokens - seq.completion_tokens)

    def seconds(self, seq: Request) -> float:
        """The cheaper of the draft's own forward and, where the target's cache can fill the
        draft's, a handoff of all but the newest token and a step that feeds that one."""
        computed = self.computed_seconds(seq)
        return min(computed, self.handed_off_seconds(seq)) if self.kv_handoff is not None else computed

    def hands_off(self, seq: Request) -> bool:
        """Whether the catch-up is cheaper handed off than computed; without the draft's costs to
        weigh it by (a fixed K), always: a copy beat the draft's forward at every length measured."""
        if self.kv_handoff is None:
            return False
        return self.costs.draft is None or self.handed_off_seconds(seq) < self.computed_seconds(seq)

    def handed_off_seconds(self, seq: Request) -> float:
        assert self.costs.draft is not None
        return self.handoff_cost.seconds(seq.draft_pending - 1) + self.costs.draft.step(1)

    def computed_seconds(self, seq: Request) -> float:
        """The draft's forward over what it has not seen of `seq`: the table's seconds, their part
        past its widest chunk corrected by what catch-ups measured. The table as measured, not
        scaled by the draft's steps since: a catch-up runs eager, as the table's wide chunks did,
        while the steps may run compiled graphs loaded after start-up."""
        assert self.costs.draft is not None
        within, beyond = catch_up_forward(seq, self.costs.draft)
        return within + self.scale(catch_up_class(seq.draft_pending)) * beyond

    def scale(self, length_class: int) -> float:
        """The correction of catch-ups of `length_class`: its own, else the nearest class's that
        catch-ups measured (a shorter one first), else none."""
        scales = self.costs.catch_up_scales
        if not scales:
            return 1.0
        nearest = min(scales, key=lambda c: (abs(c - length_class), c > length_class))
        return scales[nearest].value

    def renting(self, candidates: list[tuple[Request, CatchUp]], round_s: float) -> set[str]:
        """The `candidates` (requests that may also look up) whose catch-up waits this round: each
        pays one only once waiting has cost it as much as the catch-up itself (the ski-rental
        rule: at most twice the better of the two choices made in hindsight). A catch-up of at
        most `RENT_FROM_ROUNDS` plain rounds (a chat prompt's) waits for none."""
        return {s.slot_id for s, catch_up in candidates
                if catch_up.extra_s > RENT_FROM_ROUNDS * round_s and catch_up.extra_s > self.rent.get(s.slot_id, 0.0)}

    @staticmethod
    def caught_up_rates(
        waiting: set[str], rates: RatePredictor, choice: SourceChoice, caps: dict[str, int], steps: dict[str, int],
    ) -> dict[str, float]:
        """For each `waiting` request, the batch's best rate had its draft been caught up (its
        model draft at the best uniform K up to its cap, the others as chosen), where that beats
        the chosen rate: `charge_rent` charges the round against it."""
        if not waiting:
            return {}
        plain_steps = [steps.get(s.slot_id, 1) for s in rates.seqs] if steps else None
        chosen_rate = rates.rate(choice.ks, choice.on_lookup, plain_steps)
        caught_up = replace(rates, catch_ups=[CatchUp() if s.slot_id in waiting else c
                                              for s, c in zip(rates.seqs, rates.catch_ups)])
        out = {}
        for slot in waiting:
            ks, on_lookup = dict(choice.ks), set(choice.on_lookup) - {slot}
            best_rate = chosen_rate
            for k in range(1, caps[slot] + 1):
                ks[slot] = k
                best_rate = max(best_rate, caught_up.rate(ks, on_lookup, plain_steps))
            if best_rate > chosen_rate:
                out[slot] = best_rate
        return out

    def observe(self, plan: RoundPlan, seqs: list[Request], report: RoundReport) -> None:
        """Learn what handoffs cost, and charge each waiting request what its wait cost the round:
        the round's time past the time its tokens would have taken with that request's draft
        caught up. A round whose lookups beat the caught-up draft costs nothing, so a catch-up
        whose draft never pays is never bought."""
        for tokens, seconds in report.handoffs.values():
            self.handoff_cost.observe(tokens, seconds)
        if not plan.caught_up_rates:
            return
        emitted = sum(report.emitted(s.slot_id) for s in seqs)
        for slot, rate in plan.caught_up_rates.items():
            self.rent[slot] = self.rent.get(slot, 0.0) + max(0.0, report.total_s - emitted / rate)
            log.debug("catch-up of %s waits: %.2f s rented", slot, self.rent[slot])

    def split(self, catching: list[Request]) -> tuple[float, float]:
        """The table's seconds of the `catching` requests' catch-ups, within and beyond its widest chunk."""
        within, beyond = 0.0, 0.0
        if self.costs.draft is not None:
            for s in catching:
                part_within, part_beyond = catch_up_forward(s, self.costs.draft)
                within, beyond = within + part_within, beyond + part_beyond
        return within, beyond
