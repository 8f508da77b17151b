"""The structured workload's lines of the summary table and its section of the page."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from specdec_bench.results import BenchResults
from specdec_bench.structured import GROUP_SIZE, MASK_SHARE, RatioRow, StructuredMode, StructuredSummary


def _f(value: float, digits: int = 2, suffix: str = "") -> str:
    return "–" if value is None or math.isnan(value) else f"{value:.{digits}f}{suffix}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(row) + " |" for row in rows)]


def _requests(level: int) -> str:
    return f"{level} request{'s' if level > 1 else ''}"


def _ratio_name(r: RatioRow) -> str:
    return f"{StructuredMode(r.numerator).label} ÷ {StructuredMode(r.denominator).label}"


def _target(r: RatioRow) -> str:
    if r.minimum is None:
        return "–"
    mask = f", masks ≤ {MASK_SHARE * 100:.0f} % of a step" if r.numerator == StructuredMode.PLAIN.value else ""
    return f"≥ {r.minimum:.3g}×{mask}"


def _verdict(met: bool | None) -> str:
    return "" if met is None else "met" if met else "missed"


def _counts(pair: tuple[int, int]) -> str:
    return f"{pair[0]} / {pair[1]}"


def structured_rows(s: StructuredSummary) -> list[list[str]]:
    """The summary table's lines: each ratio with a target, validity and identical greedy outputs."""
    rows = [[f"structured, {_requests(r.concurrency)}: {_ratio_name(r)} (target {_target(r)})",
             f"{_f(r.measured, 3, '×')} ({_verdict(r.met)})"] for r in s.ratios if r.minimum is not None]
    rows.append(["structured: constrained answers that parse and satisfy their schema (target 100 %)",
                 f"{s.valid} / {s.constrained} ({_verdict(s.valid == s.constrained)})"])
    same = sum(a for a, _ in s.identical.values()), sum(b for _, b in s.identical.values())
    rows.append(["structured: greedy outputs identical in the 3 constrained modes (target all)",
                 f"{_counts(same)} ({_verdict(same[0] == same[1])})"])
    return rows


def mask_share(s: StructuredSummary, level: int) -> float:
    """The mask's cost per token as a share of an unconstrained plain decode step, from outside:
    unconstrained plain ÷ constrained plain − 1."""
    r = s.ratio(level, StructuredMode.PLAIN, StructuredMode.FREE_PLAIN)
    return 1 / r.measured - 1 if r is not None and r.measured > 0 else math.nan


def _mode_rows(s: StructuredSummary) -> list[list[str]]:
    return [[str(r.concurrency), StructuredMode(r.mode).label, _f(r.tokens_per_s.median, 1),
             f"{_f(r.tokens_per_s.min, 1)}–{_f(r.tokens_per_s.max, 1)}", str(r.tokens_per_s.n), str(r.requests),
             _f(r.mean_tokens, 1), _f(r.forced_share * 100, 0, " %"), _f(r.acceptance_rate, 3),
             f"{r.valid} / {r.requests}" if StructuredMode(r.mode).constrained else "–"] for r in s.rows]


def _description(meta: dict[str, Any]) -> str:
    return (
        f"{meta.get('prompts')} prompts answered as JSON to a schema (extractions of a person to strings, "
        "integers, an enum and a boolean; tool calls, the tool's name a constant and its arguments an object; "
        f"enum-heavy ticket triages), greedy, up to {meta.get('max_new_tokens')} new tokens, "
        f"{meta.get('repetitions')} repetition(s): each prompt alone, then a group of {GROUP_SIZE} at once, in "
        "five modes in rotating order: constrained speculative (adaptive K), constrained plain, constrained "
        "speculative through a second gateway on the same target and draft started with "
        f"`{meta.get('second_gateway')}` (forced tokens are not drafted), and unconstrained speculative and "
        "plain. An unconstrained request gets as many new tokens as the prompt's constrained plain answer had, so "
        "that lengths, contexts and batch shapes match. Alone, tok/s is the gateway's decode `tokens_per_s`; at "
        f"{GROUP_SIZE}, all completion tokens ÷ the group's wall time. Ratios are medians over the slots (a prompt "
        "alone, or a group, run once per mode back to back) of the two modes' ratio. Forced-token share: draft "
        "tokens the grammar forced (`specdec_spec_decode_num_forced_tokens_total`, read around each group: the "
        "grammar's own drafts and the draft model's forced guesses; all are kept) ÷ completion tokens."
    )


def _findings(summary: StructuredSummary) -> list[str]:
    levels = sorted(summary.identical)
    return [
        "- **Mask cost**, read from outside (the gateway walks the grammar and the target applies the masks, and "
        "neither reports that time apart): unconstrained plain ÷ constrained plain − 1, both one token a target "
        "call, "
        + ", ".join(f"{_f(mask_share(summary, level) * 100, 1, ' %')} of a decode step at {_requests(level)}"
                    for level in levels)
        + f" (target ≤ {MASK_SHARE * 100:.0f} % at {GROUP_SIZE}). A request without a grammar is not measured "
        "beside constrained ones here.",
        f"- **Valid**: {summary.valid} of {summary.constrained} constrained answers parse as JSON, satisfy their "
        "schema and ended by stop" + (": " + "; ".join(summary.problems) if summary.problems else "") + ".",
        "- **Greedy outputs identical** in the three constrained modes: "
        + ", ".join(f"{_counts(summary.identical[level])} at {_requests(level)}" for level in levels)
        + "; unconstrained speculative and plain: "
        + ", ".join(f"{_counts(summary.free_identical[level])}" for level in levels) + ".",
    ]


def structured_section(results: BenchResults, summary: StructuredSummary | None) -> list[str]:
    """The section of the page (none when the run did not measure the workload)."""
    if results.structured is None or summary is None:
        return []
    return [
        "## Structured output", "",
        _description(results.structured.meta), "",
        f"- CPU: **{summary.cpu}**.", "",
        *_table(["requests", "mode", "median tok/s", "min–max", "samples", "answers", "mean tokens",
                 "forced-token share", "acceptance rate", "valid"], _mode_rows(summary)), "",
        *_table(["requests", "ratio", "measured", "target", ""],
                [[str(r.concurrency), _ratio_name(r), _f(r.measured, 3, "×"), _target(r), _verdict(r.met)]
                 for r in summary.ratios]), "",
        *_findings(summary), "",
    ]
