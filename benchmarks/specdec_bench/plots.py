"""The four PNG plots of a run, drawn from its `Summary` with matplotlib (no display needed)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; must precede pyplot

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from specdec_bench.analysis import PHASES, Summary  # noqa: E402

#: File names, in the order the page shows them.
PLOTS = {
    "speedup_vs_k": "speedup_vs_k.png",
    "throughput_vs_concurrency": "throughput_vs_concurrency.png",
    "acceptance_by_position": "acceptance_by_position.png",
    "round_anatomy": "round_anatomy.png",
}


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def speedup_vs_k(summary: Summary, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ks = [row.k for row in summary.k_rows]
    ax.plot(ks, [row.speedup for row in summary.k_rows], "o-", label="measured (fixed K, greedy)")
    costs = summary.headline_costs
    expected_ks = list(range(1, len(costs.expected_by_k) + 1))
    ax.plot([0, *expected_ks], [1.0, *costs.expected_by_k], "--",
            label=f"S(K), {'side-by-side' if summary.side_by_side else 'start-up'} costs")
    if summary.online is not None:
        ax.plot([0, *expected_ks], [1.0, *summary.online.expected_by_k], ":", label="S(K), online costs")
    ax.axhline(summary.greedy.speedup, color="grey", linewidth=1,
               label=f"adaptive K (default): {summary.greedy.speedup:.2f}×")
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xticks([0, *expected_ks])
    ax.set(xlabel="draft tokens per round K (0 = plain)", ylabel="speedup vs plain decoding",
           title=f"Speedup vs K (α={summary.alpha:.2f}, c={costs.c:.2f})")
    ax.legend(fontsize=8)
    return _save(fig, path)


def throughput_vs_concurrency(summary: Summary, path: Path) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8))
    levels = [row.concurrency for row in summary.concurrency]
    left.plot(levels, [r.plain_tokens_per_s for r in summary.concurrency], "o-", label="plain")
    left.plot(levels, [r.speculative_tokens_per_s for r in summary.concurrency], "s-", label="speculative (adaptive K)")
    left.set(xscale="log", xlabel="concurrent requests", ylabel="aggregate tokens/s", title="Throughput")
    right.plot(levels, [r.plain_itl_p50_ms for r in summary.concurrency], "o-", label="plain p50")
    right.plot(levels, [r.plain_itl_p95_ms for r in summary.concurrency], "o--", label="plain p95")
    right.plot(levels, [r.speculative_itl_p50_ms for r in summary.concurrency], "s-", label="speculative p50")
    right.plot(levels, [r.speculative_itl_p95_ms for r in summary.concurrency], "s--", label="speculative p95")
    right.set(xscale="log", xlabel="concurrent requests", ylabel="ms per token", title="Inter-token latency")
    for ax in (left, right):
        ax.set_xticks(levels, [str(level) for level in levels])
        ax.legend(fontsize=8)
    return _save(fig, path)


def acceptance_by_position(summary: Summary, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4))
    positions = list(range(1, len(summary.alpha_by_position) + 1))
    conditional = [0.0 if math.isnan(a) else a for a in summary.alpha_by_position]
    ax.bar(positions, conditional, color="tab:blue", alpha=0.6, label="P(accept j given 1..j−1 accepted)")
    ax.plot(positions, summary.accepted_by_position, "o-", color="tab:orange", label="P(position j accepted)")
    ax.axhline(summary.alpha, color="grey", linewidth=1, label=f"α = {summary.alpha:.3f}")
    ax.set(xlabel="draft position j", ylabel="probability", ylim=(0, 1.05), xticks=positions,
           title="Greedy acceptance by draft position (fixed-K sweep)")
    ax.legend(fontsize=8, loc="lower left")
    return _save(fig, path)


def round_anatomy(summary: Summary, path: Path) -> Path:
    names = list(summary.anatomy)
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * len(names) + 1.6))
    left = [0.0] * len(names)
    for phase in PHASES:
        shares = [summary.anatomy[n].get(phase, 0.0) for n in names]
        shares = [0.0 if math.isnan(s) else s for s in shares]
        ax.barh(names, shares, left=left, label=phase)
        left = [a + b for a, b in zip(left, shares)]
    ax.invert_yaxis()
    ax.set(xlabel="share of round time", xlim=(0, 1), title="Round anatomy (summed over requests)")
    ax.legend(fontsize=8, ncol=len(PHASES), loc="upper center", bbox_to_anchor=(0.5, -0.18))
    return _save(fig, path)


def draw_all(summary: Summary, folder: Path) -> dict[str, Path]:
    """Draw every plot into `folder`; returns name -> path."""
    folder.mkdir(parents=True, exist_ok=True)
    drawers = {
        "speedup_vs_k": speedup_vs_k,
        "throughput_vs_concurrency": throughput_vs_concurrency,
        "acceptance_by_position": acceptance_by_position,
        "round_anatomy": round_anatomy,
    }
    return {name: drawers[name](summary, folder / file) for name, file in PLOTS.items()}
