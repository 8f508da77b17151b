"""Text output of a run: the summary table, the final line, and the Markdown page."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from specdec.cost_model import ForwardCost
from specdec_bench import burst, vs_fixed_k
from specdec_bench.analysis import PHASES, CostSummary, Summary, TargetCheck, W1Summary
from specdec_bench.config import BENCH_COMPILE_BUDGET_S
from specdec_bench.first_second import DRAFTING_SHARE, FIRST_SECOND, WAITED, FirstSecondSummary
from specdec_bench.results import BenchResults
from specdec_bench.spread import Spread
from specdec_bench.structured_report import structured_rows, structured_section


def _f(value: float, digits: int = 2, suffix: str = "") -> str:
    return "–" if value is None or math.isnan(value) else f"{value:.{digits}f}{suffix}"


def _spread(s: Spread, digits: int = 1) -> str:
    if s.n == 0:
        return "–"
    return f"{_f(s.median, digits)} [{_f(s.min, digits)}–{_f(s.max, digits)}]"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def summary_table(summary: Summary) -> str:
    """The headline figures as one Markdown table (printed at the end of a run)."""
    g, t, st = summary.greedy, summary.sampled, summary.startup
    online, paired = summary.online, summary.side_by_side
    k = summary.num_speculative_tokens
    rows = [
        ["W1 greedy tok/s, plain → speculative (median [min–max])",
         f"{_spread(g.plain)} → {_spread(g.speculative)}"],
        ["speedup, greedy", _f(g.speedup, 3, "×")],
        [f"W1 T={t.temperature:g} tok/s, plain → speculative", f"{_spread(t.plain)} → {_spread(t.speculative)}"],
        [f"speedup, T={t.temperature:g}", _f(t.speedup, 3, "×")],
        ["transformers tok/s, plain → assisted (same draft, K constant)",
         f"{_spread(summary.hf_plain)} → {_spread(summary.hf_assisted)}"],
        ["ours speculative ÷ transformers assisted", _f(summary.vs_hf_assisted, 3, "×")],
        ["ours plain ÷ transformers plain", _f(summary.vs_hf_plain, 3, "×")],
        ["α (per-token greedy acceptance)", _f(summary.alpha, 3)],
        ["acceptance rate (accepted ÷ drafted, W1 greedy); adaptive K: mean, rounds speculating",
         f"{_f(g.acceptance_rate, 3)}; {_f(g.mean_k, 2)}, {_f(g.speculating * 100, 0, ' %')}"],
        ["c = draft step ÷ target step (side by side / start-up / online)",
         f"{_f(paired.c if paired else math.nan, 3)} / {_f(st.c, 3)} / {_f(online.c if online else math.nan, 3)}"],
        [f"s(K={k}) at batch 1 / batch {summary.cost_batch} (start-up)",
         f"{_f(st.s_by_k[k - 1] if len(st.s_by_k) >= k else math.nan, 3)} / {_f(st.s_batch_b, 3)}"],
        [f"expected speedup S(K), best K ≤ {k} (K={summary.best_k}; c {'side by side' if paired else 'start-up'})",
         _f(summary.expected, 3, "×")],
        ["efficiency = measured ÷ expected", _f(summary.efficiency, 3)],
    ]
    rows += [[f"{_target_name(t)} (target ≥ {t.minimum:g}×)", f"{_f(t.measured, 2, '×')} ({_met(t)})"]
             for t in summary.method_targets]
    rows += [[f"adaptive K ÷ best fixed K, {v.where} (K={v.best_k}; target ≥ {vs_fixed_k.MARGIN:g}×)",
              f"{_f(v.ratio, 3, '×')} ({'met' if v.met else 'missed'})"] for v in summary.vs_fixed_k]
    if summary.burst is not None:
        rows += [[f"{r.mode}: back to ≥ {burst.SHARE * 100:.0f} % of its speed after a {summary.burst.burst_s:g} s "
                  f"CPU burst" + (f" (target ≤ {burst.TARGET_S:g} s)" if r.mode == "speculative" else ""),
                  _seconds(r.recovery_s) + (f" ({'met' if r.met else 'missed'})" if r.mode == "speculative" else "")]
                 for r in summary.burst.rows]
    if summary.structured is not None:
        rows += structured_rows(summary.structured)
    return "\n".join(_table(["figure", "value"], rows))


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def first_second_table(fs: FirstSecondSummary) -> str:
    """The first-second scenario's headline figures as one Markdown table."""
    def median(stack: str, mode: str) -> str:
        row = fs.row(stack, mode)
        return _spread(row.tokens_per_s) if row is not None else "–"

    rows = [
        [f"tok/s from a stack's traffic start + {fs.window_s:g} s: first-second / waited / plain "
         "(median [min–max])",
         f"{median(FIRST_SECOND, 'speculative')} / {median(WAITED, 'speculative')} / {median(WAITED, 'plain')}"],
        ["first-second ÷ plain", _f(fs.vs_plain, 3, "×")],
        ["first-second ÷ waited", _f(fs.vs_waited, 3, "×")],
        ["startup-to-drafting (first-second stack)", _seconds(fs.startup_to_drafting_s)],
    ]
    return "\n".join(_table(["first second", "value"], rows))


def _first_second_section(results: BenchResults, summary: Summary) -> list[str]:
    """Traffic from the first second (none if not run), with the machine and command it ran on."""
    run, fs = results.first_second, summary.first_second
    if run is None or fs is None:
        return []
    config = run.meta.get("config", {})
    machine = run.meta.get("machine", {})

    def pending(graphs: dict[str, int]) -> str:
        return f"{graphs.get('target', '?')} / {graphs.get('draft', '?')}" if graphs else "–"

    return [
        "## Traffic from the first second",
        "",
        f"Two fresh stacks, one after the other, each sent W1's greedy chat prompts ({config.get('prompts')} "
        f"prompts cycled, {config.get('max_new_tokens')} new tokens) one request at a time for "
        f"{_f(fs.span_s, 0)} s: the *first-second* stack from the moment its gateway first answered Info (t), "
        "speculative requests only (the gateway's adaptive K); the *waited* stack once both its services "
        "reported no compiled graph pending (`ModelInfo.pending_graphs` = 0) and "
        f"{_f(float(config.get('settle_s', math.nan)), 0)} s more, plain and speculative requests alternating "
        "as in W1. Both start with the services' flags of the rest of the run, the gateway as soon as the "
        "services listen (as in production: deferred graphs load while they serve); the waited stack starts "
        "first, so the first-second one starts from a warm tuning cache. Figures count the requests that start "
        f"{_f(fs.window_s, 0)} s or more after a stack's traffic began (for the first-second stack: at "
        f"t + {_f(fs.window_s, 0)} s or later); tok/s is the gateway's per-request decode `tokens_per_s`, "
        "ratios are of medians. Times are seconds after t.",
        "",
        f"- CPU: **{fs.cpu}**; git {machine.get('git', '?')}; {run.meta.get('date', '')}, "
        f"{_f(run.meta.get('duration_s', math.nan), 0)} s.",
        f"- Command: `{run.meta.get('command', '')}`",
        "",
        *_table(["stack", "mode", "median tok/s", "min–max", "n", "rounds drafting (model)", "traffic from",
                 "graphs pending at t (target / draft)", "graphs loaded", "drafting steadily from",
                 "failed in the span"],
                [[r.stack, r.mode, _f(r.tokens_per_s.median, 1),
                  f"{_f(r.tokens_per_s.min, 1)}–{_f(r.tokens_per_s.max, 1)}" if r.tokens_per_s.n else "–",
                  str(r.tokens_per_s.n),
                  _f(r.speculating * 100, 0, " %"), _f(r.traffic_from_s, 1, " s"), pending(r.pending_graphs),
                  _seconds(r.graphs_loaded_s), _seconds(r.drafting_from_s) if r.mode == "speculative" else "",
                  str(r.failed)]
                 for r in fs.rows]),
        "",
        first_second_table(fs),
        "",
        f"- **Drafting**: a speculative request drafts when at least {DRAFTING_SHARE * 100:.0f} % of its decode "
        "rounds drafted with the draft model: (`num_rounds` − `num_lookup_rounds`) ÷ (`num_rounds` + "
        "`num_plain_rounds`) of its final message's `SpeculationStats` ≥ "
        f"{DRAFTING_SHARE:g}. A planner that keeps the draft off still probes it in a few rounds, which is not "
        "drafting. *Rounds drafting* in the table is that share over the window's requests.",
        "- **Startup-to-drafting** (drafting steadily from): the start of the first request from which on every "
        "speculative request of the span drafted; *never* when the span's last one did not. A request that "
        "failed (an error status instead of its tokens; the run goes on) did not draft.",
        f"- Greedy speculative outputs compared with the waited stack's plain output of the same prompt: "
        f"{run.greedy_checked}, of which {run.greedy_mismatches} differed.",
        "",
    ]


def _planner_section(summary: Summary) -> list[str]:
    """Adaptive K against fixed K (`--fixed-k`) and the CPU burst (`--burst-s`); none if neither ran."""
    lines: list[str] = []
    if summary.vs_fixed_k:
        ks = sorted({k for v in summary.vs_fixed_k for k in v.by_k})
        lines += [
            "## Adaptive K against fixed K", "",
            "Adaptive K's tok/s ÷ each fixed K's (K = 0 is plain): the median of the ratios of requests of one "
            "prompt and repetition (W1, run back to back) or of one repetition's groups (concurrency); the best "
            "fixed K in hindsight is the one adaptive K does worst against.", "",
            *_table(["part", *(f"÷ K={k}" for k in ks), "best fixed K", "adaptive ÷ best"],
                    [[v.where, *(_f(v.by_k.get(k, math.nan), 3) for k in ks), str(v.best_k), _f(v.ratio, 3, "×")]
                     for v in summary.vs_fixed_k]), "",
        ]
    if summary.burst is not None:
        lines += [
            "## A CPU burst", "",
            f"Single greedy requests, speculative in one pass and plain in the next: {burst.LEAD_S:g} s and "
            f"{burst.MIN_BEFORE} requests or more steady, {summary.burst.burst_s:g} s with two busy processes "
            f"taking both cores, {burst.TAIL_S:g} s after. "
            f"Recovery: seconds from the burst's end to the first {burst.RUN} requests in a row whose median "
            f"tok/s is ≥ {burst.SHARE * 100:.0f} % of the median before; *after* counts the requests from "
            f"{burst.TARGET_S:g} s after the burst's end.", "",
            *_table(["mode", "before tok/s", "during", "after", "after ÷ before", "recovery",
                     "rounds drafting before / during / after", "failed"],
                    [[r.mode, _spread(r.before), _spread(r.during), _spread(r.after),
                      _f(r.after.median / r.before.median if r.before.n else math.nan, 3), _seconds(r.recovery_s),
                      " / ".join(_f(d * 100, 0, " %") for d in r.drafting), str(r.failed)]
                     for r in summary.burst.rows]), "",
        ]
    return lines


#: How the page names the drafting methods (`DraftMethod` values).
METHOD_NAMES = {"none": "plain", "model": "model draft", "ngram": "lookup alone (no draft service)", "auto": "auto"}


def _target_name(t: TargetCheck) -> str:
    return f"{t.workload}: {METHOD_NAMES.get(t.method, t.method)} ÷ {METHOD_NAMES.get(t.baseline, t.baseline)}"


def _met(t: TargetCheck) -> str:
    return "met" if t.met else "missed"


def _method_section(results: BenchResults, summary: Summary) -> list[str]:
    """The drafting-method comparison: per workload and method, and the targets (none if not run)."""
    if not summary.methods:
        return []
    config = results.meta.get("config", {})
    return [
        "## Drafting methods by workload",
        "",
        f"Greedy single requests of {config.get('workload_tokens')} new tokens, each prompt once per method in "
        f"rotating order, {config.get('workload_repetitions')} repetition(s): copy-heavy (edits, rewrites, "
        "quoting, CSV and JSON transforms, spelling fixes of a given text), long-context (questions quoting or "
        "extracting a handbook of 1,500+ tokens) and the chat prompts. Plain, model draft and auto go to the "
        "gateway with the draft service; lookup alone goes to a second gateway on the same target without "
        "a draft service (the draft process stays up, idle). Both gateways run with the cross-request suffix "
        "cache off, as every prompt is sent once per method: it would copy an earlier identical answer. "
        "Ratios are medians over the (prompt, repetition) pairs. Every method's output was checked token for "
        "token against plain output.",
        "",
        *_table(["workload", "method", "median tok/s", "min–max", "n", "÷ plain", "÷ model draft",
                 "acceptance rate", "mean acceptance length", "lookup share of draft tokens",
                 "guessed share of draft tokens", "prompt tokens"],
                [[r.workload, METHOD_NAMES.get(r.method, r.method), _f(r.tokens_per_s.median, 1),
                  f"{_f(r.tokens_per_s.min, 1)}–{_f(r.tokens_per_s.max, 1)}", str(r.tokens_per_s.n),
                  _f(r.vs_plain, 2, "×"), _f(r.vs_model, 2, "×"), _f(r.acceptance_rate, 3),
                  _f(r.mean_acceptance_length, 2), _f(r.lookup_share * 100, 0, " %"),
                  _f(r.guessed_share * 100, 0, " %"), _f(r.mean_prompt_tokens, 0)]
                 for r in summary.methods]),
        "",
        "Targets (issue 37):",
        "",
        *_table(["ratio", "target", "measured", ""],
                [[_target_name(t), f"≥ {t.minimum:g}×", _f(t.measured, 2, "×"), _met(t)]
                 for t in summary.method_targets]),
        "",
    ]


def _w1_rows(w: W1Summary) -> list[list[str]]:
    label = "greedy" if w.temperature == 0 else f"T={w.temperature:g}"
    rows = []
    for mode, s in (("plain", w.plain), ("speculative", w.speculative)):
        spec = mode == "speculative"
        rows.append([
            label, mode, _f(s.median, 1), f"{_f(s.min, 1)}–{_f(s.max, 1)}", f"{_f(s.q1, 1)}–{_f(s.q3, 1)}",
            str(s.n), _f(w.speedup, 3, "×") if spec else "", _f(w.acceptance_rate, 3) if spec else "",
            _f(w.mean_acceptance_length, 2) if spec else "", _f(w.mean_k, 2) if spec else "",
            _f(w.speculating * 100, 0, " %") if spec else "",
        ])
    return rows


def _cost_rows(costs: CostSummary, batch: int) -> list[str]:
    s = " / ".join(_f(x, 3) for x in costs.s_by_k)
    return [costs.source, _f(costs.target_step_s * 1e3, 1), _f(costs.draft_step_s * 1e3, 1), _f(costs.c, 3), s,
            _f(costs.s_batch_b, 3)]


def _load(loadavg: Sequence[float] | None) -> str:
    """The load averages a run ended with (runs before they were recorded: none)."""
    return f"; load average as it ended (1 / 5 / 15 min) {' / '.join(map(str, loadavg))}" if loadavg else ""


def _image(plot: Path, docs: Path, alt: str) -> str:
    return f"![{alt}]({Path(os.path.relpath(plot, docs.parent)).as_posix()})"


def _cost_point(cost: ForwardCost) -> str:
    return f"{cost.batch_size}×{cost.tokens}" + (f" @{cost.context}" if cost.context else "")


def render_page(results: BenchResults, summary: Summary, plots: dict[str, Path], docs: Path, results_path: Path) -> str:
    """The whole `docs/benchmarks.md`, from the results and their summary."""
    m, costs = results.meta, results.costs
    machine = m.get("machine", {})
    config = m.get("config", {})
    relative_results = Path(os.path.relpath(results_path, docs.parent)).as_posix()
    lines = [
        "# Benchmarks",
        "",
        f"<!-- Generated by `specdec bench` from {relative_results}. Do not edit: rerun "
        f"`specdec bench --render-only{' --quick' if config.get('quick') else ''} "
        f"--results {config.get('results', results_path)}` "
        "to redraw it and its plots from the JSON. -->",
        "",
        "Speed of the three-process stack (target, draft and gateway as separate processes, real gRPC) "
        "on one machine, in one run, with the variants interleaved. Definitions are at the end.",
        "",
        "## Machine and command",
        "",
        f"- CPU: **{machine.get('cpu_model', '?')}**, {machine.get('cpus', '?')} logical CPUs"
        f"{', ' + machine['hypervisor'] + ' guest' if machine.get('hypervisor') else ''}; "
        f"torch {machine.get('torch', '?')} ({machine.get('torch_threads', '?')} threads), "
        f"transformers {machine.get('transformers', '?')}, Python {machine.get('python', '?')}; "
        f"git {machine.get('git', '?')}; {m.get('date', '')}, {_f(m.get('duration_s', math.nan), 0)} s"
        f"{_load(machine.get('loadavg'))}.",
        f"- Models: target `{costs.target_model}` ({costs.target_dtype}; "
        f"compiled: {', '.join(costs.target_compiled_steps) or 'none, eager'}), draft `{costs.draft_model}` "
        f"({costs.draft_dtype}{', ' + costs.draft_quantization if costs.draft_quantization else ''}; "
        f"compiled: {', '.join(costs.draft_compiled_steps) or 'none, eager'}); "
        f"gateway default K = {costs.default_num_speculative_tokens}, "
        f"adaptive K {'on' if costs.adaptive_k else 'off'}.",
        f"- Workload: {config.get('prompts')} chat prompts × {config.get('max_new_tokens')} new tokens, "
        f"{config.get('repetitions')} repetition(s); sampled variant T = {config.get('temperature')} with a fixed seed "
        f"per prompt; concurrency requests {config.get('concurrency_tokens')} tokens each, "
        f"{config.get('concurrency_repetitions', 1)} repetition(s) per level and mode. Both services run with "
        "`--no-prefix-caching` (unless the command says otherwise): every prompt is sent more than once, and "
        "each prefill is computed in full, as for a prompt seen for the first time. The draft runs with "
        f"`--compile-budget-s {BENCH_COMPILE_BUDGET_S:.0f}`: it builds all its compiled graphs even from a "
        "cold compile cache, as a default service does after a restart or two from a warm one; otherwise the "
        "figures would depend on how many starts came before.",
        "- Command:",
        "",
        "```",
        str(m.get("command", "")),
        "```",
        "",
        "<details><summary>CPU flags (lscpu)</summary>",
        "",
        "```",
        str(machine.get("cpu_flags", "")),
        "```",
        "",
        "</details>",
        "",
        "## Summary",
        "",
        summary_table(summary),
        "",
        "```",
        summary.final_line(),
        "```",
        "",
        "## W1: single request",
        "",
        "Decode tokens/s after the first token (the gateway's `tokens_per_s`), per request; plain and "
        "speculative runs of each prompt alternate. Mean K and rounds speculating count every decode round "
        "(K = 0 rounds included) of the adaptive planner. Greedy speculative output was checked token for token "
        "against plain output (the run aborts otherwise).",
        "",
        *_table(["decoding", "mode", "median tok/s", "min–max", "IQR", "n", "speedup", "acceptance rate",
                 "mean acceptance length", "mean K", "rounds speculating"],
                _w1_rows(summary.greedy) + _w1_rows(summary.sampled)),
        "",
        "## Peers: transformers on the same weights",
        "",
        f"`generate(do_sample=False)` on the target as the target service loads it, and assisted generation with "
        f"the draft service's own model (same dtype and quantization) drafting a constant K = "
        f"{costs.default_num_speculative_tokens}. "
        f"Decode tokens/s = (N − 1) ÷ (time of N tokens − time of 1 token). "
        f"transformers' greedy output equals ours on {_f(summary.hf_matches_ours * 100, 0, ' %')} of the prompts.",
        "",
        *_table(["implementation", "median tok/s", "min–max", "n"], [
            ["ours, plain", _f(summary.greedy.plain.median, 1),
             f"{_f(summary.greedy.plain.min, 1)}–{_f(summary.greedy.plain.max, 1)}", str(summary.greedy.plain.n)],
            ["ours, speculative (adaptive K)", _f(summary.greedy.speculative.median, 1),
             f"{_f(summary.greedy.speculative.min, 1)}–{_f(summary.greedy.speculative.max, 1)}",
             str(summary.greedy.speculative.n)],
            ["transformers, plain", _f(summary.hf_plain.median, 1),
             f"{_f(summary.hf_plain.min, 1)}–{_f(summary.hf_plain.max, 1)}", str(summary.hf_plain.n)],
            ["transformers, assisted", _f(summary.hf_assisted.median, 1),
             f"{_f(summary.hf_assisted.min, 1)}–{_f(summary.hf_assisted.max, 1)}", str(summary.hf_assisted.n)],
        ]),
        "",
        "## Costs",
        "",
        "Side by side: one-step and 5-step calls to the draft (Propose) and the target (multi-step Verify), in turn "
        "on a scratch slot during W1; a step is the difference per extra step of the compute seconds the services "
        "report, c the median of the pairs' ratios, and s(K) the start-up one. "
        "The headline c and expected S(K) use it. "
        "Start-up: the forward costs each service measured when it started (`ModelInfo.forward_costs`), ~40 s "
        "apart. Online: compute seconds the services reported for the fixed-K sweep's rounds (`anatomy`); its "
        "draft step includes each Propose's catch-up feed.",
        "",
        *_table(["source", "target step ms", "draft step ms", "c", "s(K) at batch 1, K = 1, 2, …",
                 f"s(K={costs.default_num_speculative_tokens}) at batch {summary.cost_batch}"],
                [_cost_rows(costs_of, summary.cost_batch)
                 for costs_of in (summary.side_by_side, summary.startup, summary.online) if costs_of is not None]),
        "",
        "Forward milliseconds measured at start-up (batch × tokens per request, @ cached tokens per request):",
        "",
        *_table(["service", *(_cost_point(c) for c in costs.target)],
                [["target", *(_f(c.seconds * 1e3, 1) for c in costs.target)]]),
        "",
        *_table(["service", *(_cost_point(c) for c in costs.draft)],
                [["draft", *(_f(c.seconds * 1e3, 1) for c in costs.draft)]]),
        "",
        "## Fixed K",
        "",
        "Greedy single requests with K fixed (adaptive off); K = 0 is plain decoding. Expected: S(K) from "
        f"α and the {'side-by-side' if summary.side_by_side else 'start-up'} costs.",
        "",
        *_table(["K", "median tok/s", "speedup", "acceptance rate", "mean acceptance length", "expected S(K)",
                 "efficiency"],
                [[str(r.k), _f(r.tokens_per_s, 1), _f(r.speedup, 3, "×"), _f(r.acceptance_rate, 3),
                  _f(r.mean_acceptance_length, 2), _f(r.expected, 3, "×"), _f(r.efficiency, 3)]
                 for r in summary.k_rows]),
        "",
        _image(plots["speedup_vs_k"], docs, "speedup vs K"),
        "",
        "## Acceptance by draft position",
        "",
        f"From the gateway's `specdec_spec_decode_num_accepted_tokens_per_pos_total` and "
        f"`specdec_spec_decode_num_drafts_total`, read around "
        f"each fixed-K request. α = {_f(summary.alpha, 3)} ({summary.alpha_source}).",
        "",
        *_table(["position j", "P(accept j given 1..j−1 accepted)", "P(position j accepted)"],
                [[str(j + 1), _f(a, 3), _f(u, 3)]
                 for j, (a, u) in enumerate(zip(summary.alpha_by_position, summary.accepted_by_position))]),
        "",
        _image(plots["acceptance_by_position"], docs, "acceptance by position"),
        "",
        "## Concurrency",
        "",
        "N greedy requests sent at once; aggregate tokens/s = all completion tokens ÷ wall time (median over "
        "the repetitions); inter-token latency per request = (total − time to first token) ÷ (tokens − 1), "
        "percentiles over the requests of all repetitions.",
        "",
        *_table(["requests", "plain tok/s", "speculative tok/s", "speedup", "plain ITL p50 / p95 ms",
                 "speculative ITL p50 / p95 ms", "speculative: mean K, rounds speculating"],
                [[str(r.concurrency), _f(r.plain_tokens_per_s, 1), _f(r.speculative_tokens_per_s, 1),
                  _f(r.speedup, 3, "×"), f"{_f(r.plain_itl_p50_ms, 0)} / {_f(r.plain_itl_p95_ms, 0)}",
                  f"{_f(r.speculative_itl_p50_ms, 0)} / {_f(r.speculative_itl_p95_ms, 0)}",
                  f"{_f(r.speculative_mean_k, 2)}, {_f(r.speculative_speculating * 100, 0, ' %')}"]
                 for r in summary.concurrency]),
        "",
        _image(plots["throughput_vs_concurrency"], docs, "throughput vs concurrency"),
        "",
        *_method_section(results, summary),
        *_first_second_section(results, summary),
        *_planner_section(summary),
        *structured_section(results, summary.structured),
        "## Round anatomy",
        "",
        "Share of round time per phase, summed over requests (`Completion.anatomy`): W1 plain (both "
        "temperatures), W1 speculative greedy and sampled, and each K of the fixed-K sweep (greedy).",
        "",
        *_table(["requests", *PHASES],
                [[name, *(_f(shares.get(p, math.nan) * 100, 1, " %") for p in PHASES)]
                 for name, shares in summary.anatomy.items()]),
        "",
        _image(plots["round_anatomy"], docs, "round anatomy"),
        "",
        "## Definitions",
        "",
        "- **speedup**: median speculative ÷ median plain decode tokens/s (W1 greedy, adaptive K).",
        "- **c**: the draft's 1-token step ÷ the target's 1-token step. **s(K, B)**: (T(B, K+1) − T(B, 1)) ÷ "
        "(K · T(B, 1)), the extra cost of each verified token, T(B, t) being a forward over B requests of t tokens.",
        "- **α**: per-token greedy acceptance, accepted ÷ (accepted + rejecting rounds) over the fixed-K sweep (the "
        "maximum-likelihood α of the geometric model behind S(K)). The acceptance rate, accepted ÷ drafted, is lower "
        "by construction.",
        "- **S(K)** = [(1 − α^(K+1)) ÷ (1 − α)] ÷ (K·c + 1 + K·s(K)) (`specdec.cost_model.expected_speedup`)."
        " The adaptive gateway's expected speedup is the best S(K) over K ≤ its default K (1 when none pays); "
        "**efficiency** = measured ÷ expected.",
        "",
    ]
    return "\n".join(lines)
