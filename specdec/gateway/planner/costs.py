"""What rounds cost, as the planner prices them: the services' start-up cost tables, corrected
online by what rounds measure, and the round's overhead outside the services.

A table is never rescaled by timings taken while a service warms up (`Warmup`): steps measured
while compiled graphs load beside them, or in a service's first rounds after a (re)start, are
slower than the service will be, and a correction learnt from them would price the draft out
until the next sample.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.cost_model import VERIFY_MAX_TOKENS, CostTable, ForwardCost, RoundCostModel
from specdec.gateway.planner.estimates import DraftOverhead, Mean, Scale
from specdec.gateway.request import Request
from specdec.gateway.rounds import RoundPlan, RoundReport

log = logging.getLogger(__name__)

#: Rounds after a service (re)starts, or finishes loading its compiled steps, whose timings
#: teach nothing: a compiled graph's first calls and a cold cache are slower than the rest.
WARMUP_ROUNDS = 4
#: A service's forwards count as merged with other gateways' calls (logged) once they carry
#: this many rows per row of this gateway's, and as its own again below the second figure.
MERGED_FROM, MERGED_UNTIL = 1.25, 1.1
#: A plain round's overhead at most this share of a target step counts as cheap
#: (`CostEstimates.calls_are_cheap`): on CPU it is a few percent and a lookup request's one-step
#: plain rounds paid; on a GPU a call can cost a fifth of a step, which multi-step rounds save.
CHEAP_CALL_SHARE = 0.1


def catch_up_class(tokens: int) -> int:
    """The length class of a catch-up of `tokens` tokens: their count's power of two."""
    return max(tokens, 1).bit_length()


@dataclass
class Warmup:
    """Which services are warming up: loading compiled steps (their Info's pending graphs), or
    within `WARMUP_ROUNDS` rounds of a (re)start or of their last graph loading."""

    loading: set[str] = field(default_factory=set)
    rounds_left: dict[str, int] = field(default_factory=dict)

    def note(self, service: str, pending_graphs: int) -> None:
        """The service's latest Info said it has `pending_graphs` compiled graphs to load."""
        if pending_graphs > 0:
            if service not in self.loading:
                log.info("planner: the %s is loading %d compiled graphs; its timings are not learnt from until "
                         "it is done", service, pending_graphs)
            self.loading.add(service)
        elif service in self.loading:
            self.loading.discard(service)
            self.rounds_left[service] = WARMUP_ROUNDS

    def restarted(self, service: str) -> None:
        self.rounds_left[service] = WARMUP_ROUNDS

    @property
    def steady(self) -> bool:
        return not self.loading and not any(self.rounds_left.values())

    def round_done(self) -> None:
        for service, left in self.rounds_left.items():
            self.rounds_left[service] = max(0, left - 1)


@dataclass
class ForwardRows:
    """Rows of a service's forwards per row of this gateway's calls, averaged as `Mean`: 1 while
    the forwards are its own, more while the service merges other gateways' calls into them
    (`specdec.serving.call_merger`). A round lasts the merged forward, and the K that pays for
    a batch of 4 drafts too much for the 8 rows the forward carries: the tables price forwards
    of this many times the gateway's rows (`CostTable.shared`)."""

    service: str
    mean: Mean = field(default_factory=lambda: Mean(1.0))
    merged: bool = False

    @property
    def value(self) -> float:
        return self.mean.value

    def observe(self, run_items: int, own_items: int, weight: float, now: float) -> None:
        """A call of `own_items` items was answered by a forward of `run_items` (0: not reported)."""
        if run_items <= 0 or own_items <= 0:
            return
        self.mean.observe(rows_factor(run_items, own_items), weight, now)
        merged = self.value >= MERGED_FROM or (self.merged and self.value > MERGED_UNTIL)
        if merged != self.merged:
            self.merged = merged
            log.info("planner: the %s's forwards %s other gateways' calls (%.2f rows per row of this gateway's): "
                     "rounds are priced for the forwards they run in", self.service,
                     "carry" if merged else "no longer carry", self.value)


def rows_factor(run_items: int, own_items: int) -> float:
    """Rows of the forward per row of the call, from one response (1 where not reported)."""
    return max(1.0, run_items / own_items) if run_items > 0 and own_items > 0 else 1.0


@dataclass
class CostEstimates:
    """The cost tables, their online scales and the round overheads (see the module docstring)."""

    target_costs: Sequence[ForwardCost]
    draft_costs: Sequence[ForwardCost]
    #: EMA weight per round of the scales and overheads.
    weight: float = 0.1
    #: A plain round's seconds outside the services' compute (RPCs, acceptance).
    overhead_s: float = 0.0
    #: Seconds each verified lookup token adds to a round's overhead (wire, acceptance).
    lookup_token_overhead_s: float = 0.0
    draft_overhead: DraftOverhead = field(init=False)
    target: CostTable | None = field(init=False)
    draft: CostTable | None = field(init=False)
    target_scale: Scale = field(default_factory=Scale, init=False)
    draft_scale: Scale = field(default_factory=Scale, init=False)
    #: Measured ÷ predicted seconds of the draft's catch-ups past its table's widest chunk, per
    #: `catch_up_class` of their length.
    catch_up_scales: dict[int, Scale] = field(default_factory=dict, init=False)
    warmup: Warmup = field(default_factory=Warmup, init=False)
    target_rows: ForwardRows = field(default_factory=lambda: ForwardRows("target"), init=False)
    draft_rows: ForwardRows = field(default_factory=lambda: ForwardRows("draft"), init=False)

    def __post_init__(self) -> None:
        self.draft_overhead = DraftOverhead(self.weight)
        self.target = CostTable(self.target_costs) if self.target_costs else None
        self.draft = CostTable(self.draft_costs) if self.draft_costs else None

    def set_costs(self, service: str, costs: Sequence[ForwardCost]) -> None:
        """A service came back with other start-up costs: plan with them, measured afresh."""
        table = CostTable(costs) if costs else None
        if service == "target":
            self.target = table
        else:
            self.draft = table
        self.restarted(service)

    def restarted(self, service: str) -> None:
        """A service (re)started: its online corrections are forgotten (its speed may differ,
        even with the same cost table from the tuning cache), and it warms up again."""
        if service == "target":
            self.target_scale = Scale()
        else:
            self.draft_scale, self.catch_up_scales = Scale(), {}
            self.draft_overhead = DraftOverhead(self.weight)
        self.warmup.restarted(service)

    def remeasure_draft(self) -> None:
        """A probe of the model draft begins: its next timings replace what the draft's scale and
        overhead hold, rather than being averaged with the samples that kept it off."""
        self.draft_scale.seen = 0
        self.draft_overhead.restart()

    def cost_model(self, context: float | None = None) -> RoundCostModel:
        """The round cost model with the online scales, pricing requests that hold `context`
        cached tokens on average (default: the context the services measured at)."""
        if self.target is None:
            raise RuntimeError("no target cost table: the target did not measure its costs")
        target, draft = self.at_context(context)
        return RoundCostModel(
            target=target.scaled(self.target_scale.value).shared(self.target_rows.value),
            draft=draft.scaled(self.draft_scale.value).shared(self.draft_rows.value) if draft else None,
            overhead_s=self.overhead_s,
            draft_round_overhead_s=self.draft_overhead.per_round,
            draft_token_overhead_s=self.draft_overhead.per_token,
            lookup_token_overhead_s=self.lookup_token_overhead_s,
        )

    def at_context(self, context: float | None) -> tuple[CostTable, CostTable | None]:
        """Both unscaled tables at `context` (as measured when None)."""
        assert self.target is not None
        if context is None:
            return self.target, self.draft
        return self.target.at_context(context), self.draft.at_context(context) if self.draft else None

    def calls_are_cheap(self, batch_size: int) -> bool:
        """Whether a plain round's measured overhead (the call, acceptance) is at most
        `CHEAP_CALL_SHARE` of a target step for `batch_size` requests: then a multi-step plain
        round saves little, and a request that drafts by lookup gains more from a lookup after
        every token (docs/performance.md#plain-rounds-of-requests-that-look-up)."""
        if self.target is None:
            return False
        return self.overhead_s <= CHEAP_CALL_SHARE * self.target.step(batch_size) * self.target_scale.value

    def forced_prefix_pays(self, batch_size: int, forced: int, k: int) -> bool:
        """Whether `forced` certain tokens fed ahead of a request's k-token model draft widen the
        draft's batched first forward (every row padded to the widest) by no more than the
        request's share of the Propose, as the draft's table prices them: on a GPU, or alone,
        width is nearly free; on a CPU at batch 16 it is not, and the forced tokens then make the
        request's draft alone (`grammar.rounds.with_forced_tokens`). Unpriced: only alone."""
        if self.draft is None:
            return batch_size == 1
        first = self.draft.seconds(batch_size, 2)  # a round's usual feed: the bonus token, maybe one more
        wider = self.draft.seconds(batch_size, 2 + forced) - first
        return batch_size * wider <= first + max(0, k - 1) * self.draft.step(batch_size)

    def draft_cost_ratio(self) -> float:
        """The draft's 1-token step ÷ the target's at batch 1, as priced now (NaN without both)."""
        if self.target is None or self.draft is None:
            return float("nan")
        return self.draft.step(1) * self.draft_scale.value / (self.target.step(1) * self.target_scale.value)

    def observe(self, plan: RoundPlan, seqs: list[Request], report: RoundReport, now: float) -> None:
        """Learn how many rows the services' forwards carried, and the scales and overheads from
        a finished round unless a service warms up."""
        ks = [report.ks[s.slot_id] for s in seqs]
        drafts = [0 if s.slot_id in plan.lookups else k for s, k in zip(seqs, ks)]  # the model draft's
        proposed = sum(1 for d in drafts if d)
        self.target_rows.observe(report.verify.run_items, len(seqs), self.weight, now)
        self.draft_rows.observe(report.propose.run_items, proposed, self.weight, now)
        steady = self.warmup.steady
        self.warmup.round_done()
        if not steady:
            return
        if self.target is not None:
            target, draft = self.at_context(plan.context)
            # The EMAs track measured ÷ this: the forwards as they ran, merged calls' rows included.
            unscaled = RoundCostModel(target.shared(rows_factor(report.verify.run_items, len(seqs))),
                                      draft.shared(rows_factor(report.propose.run_items, proposed)) if draft else None)
            predicted = unscaled.verify_seconds(ks, [report.steps_of(s.slot_id) for s in seqs])
            self.target_scale.observe_ratio(report.verify.compute_s, predicted, self.weight, now)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("costs: batch %d, K %s, verify %.1f ms measured ÷ %.1f ms unscaled (scale %.2f), "
                          "propose %.1f ms (scale %.2f)", len(seqs), ks, 1e3 * report.verify.compute_s,
                          1e3 * predicted, self.target_scale.value, 1e3 * report.propose.compute_s,
                          self.draft_scale.value)
            if any(drafts):
                self._observe_draft(plan, seqs, report, unscaled, drafts, now)
        self._observe_overhead(sum(drafts), sum(ks) - sum(drafts), report.overhead_s, now)

    def _observe_draft(self, plan: RoundPlan, seqs: list[Request], report: RoundReport, unscaled: RoundCostModel,
                       drafts: list[int], now: float) -> None:
        """The draft's scale from a round whose catch-ups (if any) are verify-sized, priced as the
        first forward's width: a draft that falls a plain round behind after every drafted round
        must still teach its step cost. From a round with a catch-up past the table's widest
        chunk, that catch-up's correction (the Propose's time past its steps)."""
        guesses = [len(g.tokens) if (g := plan.guesses.get(s.slot_id)) else 0 for s in seqs]
        # A verify-sized catch-up (a plain round's tokens) runs as a step does, a first forward
        # the table prices; a prompt's runs eager, and says nothing of the steps.
        within = plan.catch_up_tokens <= VERIFY_MAX_TOKENS
        feeds = [(plan.catch_up_feeds.get(s.slot_id, 0) if within else 0) or plan.feeds.get(s.slot_id, 1) + guess
                 for s, guess in zip(seqs, guesses)]
        # A grammar's forced tokens, fed as guesses, save steps and widen forwards as a lookup's do.
        forced = [report.forced.get(s.slot_id, (0, 0)) for s in seqs]
        saved = ([float(report.guessed.get(s.slot_id, 0) + steps) for s, (steps, _) in zip(seqs, forced)]
                 if any(guesses) or any(report.guessed.values()) or report.forced else None)
        widened = [float(report.own_guess_tokens.get(s.slot_id, 0) + fed) for s, (_, fed) in zip(seqs, forced)]
        predicted = unscaled.draft_seconds(drafts, feeds, saved, widened if any(widened) else None)
        if within:
            self.draft_scale.observe_ratio(report.propose.compute_s, predicted, self.weight, now)
        elif plan.catch_up_beyond_s > 0:
            rest = predicted * self.draft_scale.value + plan.catch_up_s - plan.catch_up_beyond_s
            scale = self.catch_up_scales.setdefault(catch_up_class(plan.catch_up_tokens), Scale())
            scale.observe_ratio(report.propose.compute_s - rest, plan.catch_up_beyond_s, self.weight, now)

    def _observe_overhead(self, drafted: int, looked_up: int, overhead_s: float, now: float) -> None:
        """A round's overhead beyond the services' compute: a plain round's, plus what each
        verified lookup token adds, plus what the model draft adds (`DraftOverhead`)."""
        excess = overhead_s - self.overhead_s
        if drafted == 0 and looked_up == 0:
            self.overhead_s += self.weight * excess
        elif drafted == 0:
            per_token = max(0.0, excess) / looked_up
            self.lookup_token_overhead_s += self.weight * (per_token - self.lookup_token_overhead_s)
        else:
            self.draft_overhead.observe(drafted, excess - self.lookup_token_overhead_s * looked_up, now)
