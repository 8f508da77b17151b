"""The structured workload: its records and figures (measured by `structured_run`;
`--structured-repetitions`).

Every prompt of `structured_workload` runs greedy in each `StructuredMode`, the modes in
rotating order, alone (1 request) and in groups of `GROUP_SIZE` sent at once. A *slot* is
one prompt (alone) or one group's prompts (16 at once) run once per mode back to back: ratios
are medians over the slots of the two modes' tok/s ratio, and the constrained modes' greedy
outputs are compared request by request within a slot. Alone, tok/s is the gateway's decode
`tokens_per_s`; at 16, all completion tokens ÷ the group's wall time.

Unconstrained requests get as many new tokens as the same prompt's constrained plain answer
had (`StructuredRecord.max_new_tokens`): a free answer would run longer, and the comparison
of equal lengths keeps the context and, at 16, the batch's shape alike. The mask's cost is
read from outside as constrained plain ÷ unconstrained plain, both one token a target call
(`structured_run.SECOND_GATEWAY`): masks are computed by the gateway and applied by the
target, and neither reports its time apart.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from specdec_bench.spread import Spread
from specdec_bench.workloads import RunRecord

#: Requests of one concurrent group (issue 56: masking at 16 concurrent requests).
GROUP_SIZE = 16
LEVELS = (1, GROUP_SIZE)
#: Mask cost at most this share of a decode step: constrained plain ÷ unconstrained plain ≥ 1 ÷ (1 + it).
MASK_SHARE = 0.05


class StructuredMode(Enum):
    SPECULATIVE = "spec"
    PLAIN = "plain"
    #: Speculative through a second gateway started with `--no-grammar-drafts`.
    NO_GRAMMAR_DRAFTS = "spec_no_grammar_drafts"
    FREE_SPECULATIVE = "free_spec"
    FREE_PLAIN = "free_plain"

    @property
    def constrained(self) -> bool:
        return self in (StructuredMode.SPECULATIVE, StructuredMode.PLAIN, StructuredMode.NO_GRAMMAR_DRAFTS)

    @property
    def k(self) -> int | None:
        """The `run_request` K: 0 plain, None the gateway's adaptive K."""
        return 0 if self in (StructuredMode.PLAIN, StructuredMode.FREE_PLAIN) else None

    @property
    def label(self) -> str:
        return MODE_LABELS[self]


MODE_LABELS = {
    StructuredMode.SPECULATIVE: "constrained speculative", StructuredMode.PLAIN: "constrained plain",
    StructuredMode.NO_GRAMMAR_DRAFTS: "constrained speculative, no grammar drafts",
    StructuredMode.FREE_SPECULATIVE: "unconstrained speculative", StructuredMode.FREE_PLAIN: "unconstrained plain",
}
CONSTRAINED = tuple(m for m in StructuredMode if m.constrained)


@dataclass
class StructuredRecord:
    """One request of the scenario."""

    mode: str
    #: `SchemaKind` value of its prompt.
    kind: str
    run: RunRecord
    max_new_tokens: int
    finish_reason: str
    #: Why a constrained answer fails (`answer_problem`; "" = valid, and for unconstrained answers).
    problem: str = ""
    #: A digest of the output's token ids: the greedy outputs of a slot's modes are compared by it.
    output: str = ""

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StructuredRecord:
        return cls(**{**raw, "run": RunRecord(**raw["run"])})


@dataclass
class StructuredGroup:
    """`concurrency` requests of one mode sent at once (1: a single request)."""

    mode: str
    concurrency: int
    slot: int
    wall_s: float
    requests: list[StructuredRecord] = field(default_factory=list)
    #: Draft tokens the grammar forced (`spec_decode_num_forced_tokens`), from the gateway's metrics around the group.
    grammar_draft_tokens: int | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StructuredGroup:
        return cls(**{**raw, "requests": [StructuredRecord.from_dict(r) for r in raw["requests"]]})

    @property
    def completion_tokens(self) -> int:
        return sum(r.run.completion_tokens for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        """Alone: the request's decode tok/s; at once: all completion tokens ÷ the wall time."""
        if self.concurrency == 1 and len(self.requests) == 1:
            return self.requests[0].run.tokens_per_s
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else math.nan


@dataclass
class StructuredRun:
    """The scenario's groups with its settings (`meta`: repetitions, max_new_tokens, prompts, gateways)."""

    meta: dict[str, Any]
    groups: list[StructuredGroup]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StructuredRun:
        return cls(raw["meta"], [StructuredGroup.from_dict(g) for g in raw["groups"]])


@dataclass
class ModeRow:
    """One mode at one concurrency level."""

    concurrency: int
    mode: str
    tokens_per_s: Spread
    requests: int
    mean_tokens: float
    #: Grammar draft tokens ÷ completion tokens (NaN where the metrics were not read).
    forced_share: float
    #: Accepted ÷ drafted, every draft source.
    acceptance_rate: float
    #: Constrained answers that parse, satisfy their schema and ended by stop (unconstrained: 0).
    valid: int


@dataclass
class RatioRow:
    """`numerator` ÷ `denominator` at `concurrency` (pairwise median), with its target if any."""

    concurrency: int
    numerator: str
    denominator: str
    measured: float
    minimum: float | None = None

    @property
    def met(self) -> bool | None:
        return None if self.minimum is None else self.measured >= self.minimum


#: (numerator, denominator, target at 1 request, target at 16): issue 56's goals, side by side.
RATIOS: tuple[tuple[StructuredMode, StructuredMode, float | None, float | None], ...] = (
    (StructuredMode.SPECULATIVE, StructuredMode.PLAIN, 2.0, None),
    (StructuredMode.SPECULATIVE, StructuredMode.NO_GRAMMAR_DRAFTS, 1.2, None),
    (StructuredMode.SPECULATIVE, StructuredMode.FREE_SPECULATIVE, None, None),
    (StructuredMode.PLAIN, StructuredMode.FREE_PLAIN, None, 1 / (1 + MASK_SHARE)),
)


@dataclass
class StructuredSummary:
    cpu: str
    rows: list[ModeRow]
    ratios: list[RatioRow]
    #: Constrained answers that passed, of all constrained answers.
    valid: int
    constrained: int
    #: By level: (requests whose constrained modes' greedy outputs were all identical, requests compared).
    identical: dict[int, tuple[int, int]]
    #: Likewise, unconstrained speculative against unconstrained plain.
    free_identical: dict[int, tuple[int, int]]
    #: The first few problems of invalid answers ("mode, prompt: problem").
    problems: list[str] = field(default_factory=list)

    def row(self, concurrency: int, mode: StructuredMode) -> ModeRow | None:
        return next((r for r in self.rows if (r.concurrency, r.mode) == (concurrency, mode.value)), None)

    def ratio(self, concurrency: int, numerator: StructuredMode, denominator: StructuredMode) -> RatioRow | None:
        return next((r for r in self.ratios if (r.concurrency, r.numerator, r.denominator)
                     == (concurrency, numerator.value, denominator.value)), None)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 and not math.isnan(b) else math.nan


def pairwise(groups: Sequence[StructuredGroup], level: int, a: StructuredMode, b: StructuredMode) -> float:
    """Median over the slots at `level` that ran both modes of their tok/s ratio."""
    rates = {(g.mode, g.slot): g.tokens_per_s for g in groups if g.concurrency == level}
    ratios = [rate / rates[(b.value, slot)] for (mode, slot), rate in rates.items()
              if mode == a.value and rates.get((b.value, slot), 0.0) > 0]
    return statistics.median(ratios) if ratios else math.nan


def identical_outputs(groups: Sequence[StructuredGroup], level: int,
                      modes: Sequence[StructuredMode]) -> tuple[int, int]:
    """(requests whose outputs were the same in every one of `modes`, requests run in all of them)
    at `level`, request i of a slot's group compared with request i of the others."""
    outputs: dict[tuple[int, int], dict[str, str]] = {}
    for g in groups:
        if g.concurrency == level:
            for i, r in enumerate(g.requests):
                outputs.setdefault((g.slot, i), {})[g.mode] = r.output
    compared = [by_mode for by_mode in outputs.values() if all(m.value in by_mode for m in modes)]
    same = sum(len({by_mode[m.value] for m in modes}) == 1 for by_mode in compared)
    return same, len(compared)


def mode_row(groups: Sequence[StructuredGroup], level: int, mode: StructuredMode) -> ModeRow | None:
    mine = [g for g in groups if g.concurrency == level and g.mode == mode.value]
    records = [r for g in mine for r in g.requests]
    if not records:
        return None
    tokens = sum(r.run.completion_tokens for r in records)
    drafted, accepted = sum(r.run.num_draft_tokens for r in records), sum(r.run.num_accepted_tokens for r in records)
    counted = [g for g in mine if g.grammar_draft_tokens is not None]
    forced = _ratio(sum(g.grammar_draft_tokens or 0 for g in counted), sum(g.completion_tokens for g in counted))
    return ModeRow(level, mode.value, Spread.of([g.tokens_per_s for g in mine]), len(records), tokens / len(records),
                   forced, _ratio(accepted, drafted),
                   sum(r.problem == "" for r in records) if mode.constrained else 0)


def summarize_structured(run: StructuredRun, cpu: str) -> StructuredSummary:
    groups = run.groups
    levels = sorted({g.concurrency for g in groups})
    rows = [row for level in levels for mode in StructuredMode if (row := mode_row(groups, level, mode))]
    ratios = [RatioRow(level, a.value, b.value, pairwise(groups, level, a, b), alone if level == 1 else together)
              for level in levels for a, b, alone, together in RATIOS]
    constrained = [(g, r) for g in groups if StructuredMode(g.mode).constrained for r in g.requests]
    problems = [f"{StructuredMode(g.mode).label}, prompt {r.run.prompt} at {g.concurrency}: {r.problem}"
                for g, r in constrained if r.problem]
    return StructuredSummary(
        cpu, rows, ratios, sum(r.problem == "" for _, r in constrained), len(constrained),
        {level: identical_outputs(groups, level, CONSTRAINED) for level in levels},
        {level: identical_outputs(groups, level, (StructuredMode.FREE_SPECULATIVE, StructuredMode.FREE_PLAIN))
         for level in levels},
        problems[:5],
    )
