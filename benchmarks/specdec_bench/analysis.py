"""Every derived figure of a run, computed from its results document alone.

Definitions (docs/architecture.md#speed-model):

- speedup: median speculative ÷ median plain decode tokens/s (W1, greedy unless said);
- c: the draft's 1-token step ÷ the target's 1-token step; s(K, B): the verify slope, the
  extra cost of each verified token ÷ a 1-token step, (T(B, K+1) − T(B, 1)) ÷ (K·T(B, 1));
  both from the forward costs the services measured at start-up (`ModelInfo.forward_costs`)
  and, "online", from the per-request round anatomy of the fixed-K sweep. c also "side by
  side": the median ratio of draft and target steps timed in turn during W1
  (`specdec_bench.step_timing`), with s(K) from start-up (a ratio within one service's
  table, timed in interleaved passes). The headline c and S(K) use it when the run has it:
  the services' start-up tables are timed ~40 s apart, and the machine drifts meanwhile;
- α: the per-token greedy acceptance probability, the maximum-likelihood estimate of the
  geometric model behind S(K) from the fixed-K sweep's per-position counters: accepted
  draft tokens ÷ (accepted + rounds that rejected one). The acceptance *rate* (accepted ÷
  drafted, vLLM's figure) is lower by construction: positions after a rejection count as
  not accepted although they were never judged;
- S(K) = `specdec.cost_model.expected_speedup(α, K, c, s(K))`; the expected speedup of the
  adaptive gateway is the best S(K) over the Ks it may choose (1.0 when none pays);
  efficiency = measured ÷ expected.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.cost_model import CostTable, expected_speedup
from specdec_bench.burst import BurstSummary, summarize_burst
from specdec_bench.first_second import FirstSecondSummary, summarize_first_second
from specdec_bench.peers import PeerRecord
from specdec_bench.results import BenchResults
from specdec_bench.spread import Spread, percentile
from specdec_bench.step_timing import side_by_side_c
from specdec_bench.structured import StructuredSummary, summarize_structured
from specdec_bench.sweeps import ConcurrencyGroup
from specdec_bench.vs_fixed_k import VsFixedK, vs_fixed_k
from specdec_bench.workloads import DraftMethod, RunRecord, Workload

PHASES = ("draft_compute", "verify_compute", "rpc", "accept", "other")


@dataclass
class W1Summary:
    """Single-request decode tokens/s, by temperature and mode."""

    temperature: float
    plain: Spread
    speculative: Spread
    speedup: float
    acceptance_rate: float
    mean_acceptance_length: float
    #: Mean K the adaptive planner chose per round, plain (K = 0) rounds included.
    mean_k: float
    #: Share of rounds that speculated (K >= 1).
    speculating: float


@dataclass
class CostSummary:
    """c, s and per-K S(K), from start-up (Info) or online (anatomy) costs."""

    source: str
    target_step_s: float
    draft_step_s: float
    c: float
    #: s(K) at batch 1, K = 1..max_k (index K−1).
    s_by_k: list[float]
    s_batch_b: float
    expected_by_k: list[float]


@dataclass
class KRow:
    k: int
    tokens_per_s: float
    speedup: float
    acceptance_rate: float
    mean_acceptance_length: float
    expected: float
    efficiency: float


@dataclass
class ConcurrencyRow:
    concurrency: int
    plain_tokens_per_s: float
    speculative_tokens_per_s: float
    speedup: float
    plain_itl_p50_ms: float
    plain_itl_p95_ms: float
    speculative_itl_p50_ms: float
    speculative_itl_p95_ms: float
    speculative_mean_k: float
    speculative_speculating: float


@dataclass
class MethodRow:
    """One drafting method on one workload of the method comparison (greedy single requests)."""

    workload: str
    method: str
    tokens_per_s: Spread
    #: Median over the (prompt, repetition) pairs of this method's tok/s ÷ plain's / the model draft's.
    vs_plain: float
    vs_model: float
    acceptance_rate: float
    mean_acceptance_length: float
    #: Share of the draft tokens that lookups proposed alone, and that lookups gave the draft
    #: model as its guess (draft steps saved).
    lookup_share: float
    mean_prompt_tokens: float
    guessed_share: float = math.nan


@dataclass(frozen=True)
class MethodTarget:
    """A goal of the method comparison: `method` ÷ `baseline` on `workload` at least `minimum`."""

    workload: Workload
    method: DraftMethod
    baseline: DraftMethod
    minimum: float


#: Issue 37's targets for drafting without a draft model (pairwise median ratios).
METHOD_TARGETS = (
    MethodTarget(Workload.COPY_HEAVY, DraftMethod.AUTO, DraftMethod.PLAIN, 3.0),
    MethodTarget(Workload.COPY_HEAVY, DraftMethod.AUTO, DraftMethod.MODEL, 1.3),
    MethodTarget(Workload.COPY_HEAVY, DraftMethod.NGRAM, DraftMethod.PLAIN, 2.0),
    MethodTarget(Workload.LONG_CONTEXT, DraftMethod.AUTO, DraftMethod.PLAIN, 1.5),
    MethodTarget(Workload.CHAT, DraftMethod.AUTO, DraftMethod.MODEL, 0.98),
)


@dataclass
class TargetCheck:
    workload: str
    method: str
    baseline: str
    minimum: float
    measured: float
    met: bool


@dataclass
class Summary:
    """The figures the report prints, plots and writes to the page."""

    greedy: W1Summary
    sampled: W1Summary
    alpha: float
    alpha_source: str
    #: Conditional acceptance of draft position j+1 given positions 1..j were accepted.
    alpha_by_position: list[float]
    #: Unconditional: the share of rounds whose position j+1 was accepted.
    accepted_by_position: list[float]
    startup: CostSummary
    online: CostSummary | None
    #: c from W1's alternating step probes (None for runs without them).
    side_by_side: CostSummary | None
    cost_batch: int
    num_speculative_tokens: int
    best_k: int
    expected: float
    efficiency: float
    hf_plain: Spread
    hf_assisted: Spread
    hf_matches_ours: float
    vs_hf_assisted: float
    vs_hf_plain: float
    k_rows: list[KRow] = field(default_factory=list)
    concurrency: list[ConcurrencyRow] = field(default_factory=list)
    #: Share of round time per phase: "plain" and "speculative" (W1), "K=<k>" (sweep).
    anatomy: dict[str, dict[str, float]] = field(default_factory=dict)
    methods: list[MethodRow] = field(default_factory=list)
    method_targets: list[TargetCheck] = field(default_factory=list)
    #: Traffic from the first second (None when the run did not measure it).
    first_second: FirstSecondSummary | None = None
    #: Adaptive K ÷ the best fixed K per part of the run (`--fixed-k`; empty without).
    vs_fixed_k: list[VsFixedK] = field(default_factory=list)
    #: The noisy-neighbour burst (None when the run did not measure it).
    burst: BurstSummary | None = None
    #: The structured workload (None when the run did not measure it).
    structured: StructuredSummary | None = None

    @property
    def headline_costs(self) -> CostSummary:
        """The costs behind the headline c and expected S(K): side by side when measured."""
        return self.side_by_side or self.startup

    def final_line(self) -> str:
        return (
            f"speedup={self.greedy.speedup:.3f} vs_hf_assisted={self.vs_hf_assisted:.3f} "
            f"efficiency={self.efficiency:.3f} alpha={self.alpha:.3f} c={self.headline_costs.c:.3f}"
        )


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 and not math.isnan(b) else math.nan


def all_rounds(records: Sequence[RunRecord]) -> int:
    """Decode rounds of any K, as the gateway counted them. Results recorded before it did
    get an estimate that undercounts: every round emitting its accepted tokens plus one,
    though a stop rule may cut a round's accepted tokens (a T = 0.8 run came out at 107 %
    of rounds speculating) and a multi-step plain round emits several."""
    return sum(
        r.num_rounds + r.num_plain_rounds if r.num_plain_rounds is not None
        else max(r.completion_tokens - 1 - r.num_accepted_tokens, 0)
        for r in records
    )


def _w1(records: Sequence[RunRecord], temperature: float) -> W1Summary:
    rows = [r for r in records if r.temperature == temperature]
    plain = Spread.of([r.tokens_per_s for r in rows if r.k == 0])
    spec_rows = [r for r in rows if r.k is None]
    spec = Spread.of([r.tokens_per_s for r in spec_rows])
    drafted = sum(r.num_draft_tokens for r in spec_rows)
    accepted = sum(r.num_accepted_tokens for r in spec_rows)
    rounds = sum(r.num_rounds for r in spec_rows)
    return W1Summary(
        temperature=temperature, plain=plain, speculative=spec, speedup=_ratio(spec.median, plain.median),
        acceptance_rate=_ratio(accepted, drafted), mean_acceptance_length=1 + _ratio(accepted, rounds),
        mean_k=_ratio(drafted, all_rounds(spec_rows)), speculating=_ratio(rounds, all_rounds(spec_rows)),
    )


def acceptance_by_position(sweep: Sequence[RunRecord], max_k: int) -> tuple[list[float], list[float], float]:
    """(conditional α_j, unconditional share, pooled α) from the fixed-K sweep's counters."""
    runs = [r for r in sweep if r.k and r.num_drafts > 0 and len(r.accepted_per_pos) == r.k]
    conditional, unconditional = [], []
    for j in range(max_k):
        at = [r for r in runs if r.k is not None and r.k > j]
        reached = sum(r.num_drafts if j == 0 else r.accepted_per_pos[j - 1] for r in at)
        accepted = sum(r.accepted_per_pos[j] for r in at)
        conditional.append(_ratio(accepted, reached))
        unconditional.append(_ratio(accepted, sum(r.num_drafts for r in at)))
    successes = sum(sum(r.accepted_per_pos) for r in runs)
    failures = sum(r.num_drafts - r.accepted_per_pos[-1] for r in runs)
    return conditional, unconditional, _ratio(successes, successes + failures)


def _expected_by_k(alpha: float, c: float, s_by_k: Sequence[float]) -> list[float]:
    """S(K) for K = 1, 2, ... (NaN where s(K) was not measured)."""
    return [expected_speedup(alpha, k, c, s) if not math.isnan(s) else math.nan for k, s in enumerate(s_by_k, start=1)]


def _slope(table: CostTable, batch: int, k: int) -> float:
    step = table.seconds(batch, 1)
    return (table.seconds(batch, k + 1) - step) / (k * step)


def startup_costs(results: BenchResults, alpha: float, max_k: int, batch: int) -> CostSummary:
    target, draft = CostTable(results.costs.target), CostTable(results.costs.draft)
    c = draft.step(1) / target.step(1)
    s_by_k = [_slope(target, 1, k) for k in range(1, max_k + 1)]
    return CostSummary(
        source="start-up (ModelInfo.forward_costs)", target_step_s=target.step(1), draft_step_s=draft.step(1), c=c,
        s_by_k=s_by_k, s_batch_b=_slope(target, batch, results.costs.default_num_speculative_tokens),
        expected_by_k=_expected_by_k(alpha, c, s_by_k),
    )


def side_by_side_costs(results: BenchResults, startup: CostSummary, alpha: float) -> CostSummary | None:
    """c from the step pairs timed in turn during W1; s(K) as at start-up."""
    if not results.step_pairs:
        return None
    c, draft_step, target_step = side_by_side_c(results.step_pairs)
    return CostSummary(
        source=f"side by side ({len(results.step_pairs)} pairs of draft and target calls in turn during W1)",
        target_step_s=target_step, draft_step_s=draft_step, c=c, s_by_k=startup.s_by_k, s_batch_b=startup.s_batch_b,
        expected_by_k=_expected_by_k(alpha, c, startup.s_by_k),
    )


def online_costs(sweep: Sequence[RunRecord], alpha: float, max_k: int) -> CostSummary | None:
    """c and s(K) from the compute seconds the services reported for the sweep's own rounds."""
    plain = [r for r in sweep if r.k == 0 and r.completion_tokens > 1]
    spec = [r for r in sweep if r.k and r.num_rounds > 0 and r.num_draft_tokens > 0]
    if not plain or not spec:
        return None
    step = sum(r.anatomy.get("verify_compute", 0.0) for r in plain) / sum(r.completion_tokens - 1 for r in plain)
    draft_step = sum(r.anatomy.get("draft_compute", 0.0) for r in spec) / sum(r.num_draft_tokens for r in spec)
    c = draft_step / step
    s_by_k = []
    for k in range(1, max_k + 1):
        runs = [r for r in spec if r.k == k]
        verify = sum(r.anatomy.get("verify_compute", 0.0) for r in runs) / max(sum(r.num_rounds for r in runs), 1)
        s_by_k.append((verify - step) / (k * step) if runs else math.nan)
    return CostSummary(
        source="online (round anatomy of the fixed-K sweep)", target_step_s=step, draft_step_s=draft_step, c=c,
        s_by_k=s_by_k, s_batch_b=math.nan,
        expected_by_k=_expected_by_k(alpha, c, s_by_k),
    )


def _k_rows(sweep: Sequence[RunRecord], expected: Sequence[float]) -> list[KRow]:
    ks = sorted({r.k for r in sweep if r.k is not None})
    plain = statistics.median([r.tokens_per_s for r in sweep if r.k == 0]) if 0 in ks else math.nan
    rows = []
    for k in ks:
        runs = [r for r in sweep if r.k == k]
        rate = statistics.median([r.tokens_per_s for r in runs])
        drafted, accepted = sum(r.num_draft_tokens for r in runs), sum(r.num_accepted_tokens for r in runs)
        rounds = sum(r.num_rounds for r in runs)
        exp = expected[k - 1] if 1 <= k <= len(expected) else 1.0
        speedup = _ratio(rate, plain)
        rows.append(KRow(k, rate, speedup, _ratio(accepted, drafted), 1 + _ratio(accepted, rounds) if k else 1.0,
                         exp, _ratio(speedup, exp)))
    return rows


def _concurrency_rows(groups: Sequence[ConcurrencyGroup]) -> list[ConcurrencyRow]:
    rows = []
    for level in sorted({g.concurrency for g in groups}):
        plain = [g for g in groups if g.concurrency == level and g.k == 0]
        spec = [g for g in groups if g.concurrency == level and g.k is None]

        def rate(gs: list[ConcurrencyGroup]) -> float:
            return statistics.median([g.tokens_per_s for g in gs]) if gs else math.nan

        def itl(gs: list[ConcurrencyGroup], q: float) -> float:
            return 1e3 * percentile([r.inter_token_s for g in gs for r in g.requests], q)

        spec_requests = [r for g in spec for r in g.requests]
        rounds = all_rounds(spec_requests)
        rows.append(ConcurrencyRow(
            level, rate(plain), rate(spec), _ratio(rate(spec), rate(plain)), itl(plain, 50), itl(plain, 95),
            itl(spec, 50), itl(spec, 95), _ratio(sum(r.num_draft_tokens for r in spec_requests), rounds),
            _ratio(sum(r.num_rounds for r in spec_requests), rounds),
        ))
    return rows


def phase_seconds(records: Sequence[RunRecord]) -> dict[str, float]:
    """Round time per phase (`PHASES`), summed over `records`."""
    return {p: sum(r.anatomy.get(p, 0.0) for r in records) for p in PHASES}


def anatomy_shares(records: Sequence[RunRecord]) -> dict[str, float]:
    """Share of the summed round time per phase."""
    totals = phase_seconds(records)
    whole = sum(totals.values())
    return {p: _ratio(v, whole) for p, v in totals.items()}


def pairwise_ratio(records: Sequence[RunRecord], workload: str, method: str, baseline: str) -> float:
    """Median over the (prompt, repetition) pairs of `workload` run with both `method` and
    `baseline` of their tok/s ratio: pairs measured back to back share the machine's mood."""
    rates = {(r.method, r.prompt, r.repetition): r.tokens_per_s for r in records if r.workload == workload}
    ratios = [rate / rates[(baseline, prompt, rep)] for (m, prompt, rep), rate in rates.items()
              if m == method and rates.get((baseline, prompt, rep), 0.0) > 0]
    return statistics.median(ratios) if ratios else math.nan


def method_rows(records: Sequence[RunRecord]) -> list[MethodRow]:
    """One row per workload and method present, in `Workload` and `DraftMethod` order."""
    rows = []
    for workload in Workload:
        for method in DraftMethod:
            runs = [r for r in records if r.workload == workload.value and r.method == method.value]
            if not runs:
                continue
            drafted, accepted = sum(r.num_draft_tokens for r in runs), sum(r.num_accepted_tokens for r in runs)
            rows.append(MethodRow(
                workload.value, method.value, Spread.of([r.tokens_per_s for r in runs]),
                pairwise_ratio(records, workload.value, method.value, DraftMethod.PLAIN.value),
                pairwise_ratio(records, workload.value, method.value, DraftMethod.MODEL.value),
                _ratio(accepted, drafted), 1 + _ratio(accepted, sum(r.num_rounds for r in runs)),
                _ratio(sum(r.num_lookup_draft_tokens for r in runs), drafted),
                statistics.mean(r.prompt_tokens for r in runs),
                _ratio(sum(r.num_guessed_tokens for r in runs), drafted),
            ))
    return rows


def method_targets(records: Sequence[RunRecord]) -> list[TargetCheck]:
    """`METHOD_TARGETS` with the measured pairwise ratios (none without a method comparison)."""
    if not records:
        return []
    checks = []
    for t in METHOD_TARGETS:
        measured = pairwise_ratio(records, t.workload.value, t.method.value, t.baseline.value)
        checks.append(TargetCheck(t.workload.value, t.method.value, t.baseline.value, t.minimum, measured,
                                  met=measured >= t.minimum))
    return checks


def _peer_spread(peers: Sequence[PeerRecord], method: str) -> Spread:
    return Spread.of([p.tokens_per_s for p in peers if p.method == method and not math.isnan(p.tokens_per_s)])


def summarize(results: BenchResults) -> Summary:
    config = results.meta.get("config", {})
    temperature = float(config.get("temperature", 0.8))
    cost_batch = int(config.get("cost_batch", 4))
    max_k = max([r.k for r in results.k_sweep if r.k] + [results.costs.default_num_speculative_tokens])
    greedy, sampled = _w1(results.w1, 0.0), _w1(results.w1, temperature)
    conditional, unconditional, alpha = acceptance_by_position(results.k_sweep, max_k)
    source = "fixed-K sweep, per-position counters (geometric MLE)"
    if math.isnan(alpha):
        alpha, source = greedy.acceptance_rate, "W1 acceptance rate (no fixed-K sweep)"
    startup = startup_costs(results, alpha, max_k, cost_batch)
    online = online_costs(results.k_sweep, alpha, max_k)
    side_by_side = side_by_side_costs(results, startup, alpha)
    headline = side_by_side or startup
    cap = results.costs.default_num_speculative_tokens
    options = [(s, k) for k, s in enumerate(headline.expected_by_k[:cap], start=1)]
    expected, best_k = max(options + [(1.0, 0)])
    hf_plain, hf_assisted = _peer_spread(results.peers, "hf_plain"), _peer_spread(results.peers, "hf_assisted")
    checked = [p.matches_ours for p in results.peers if p.method == "hf_plain" and p.matches_ours is not None]
    anatomy = {"plain": anatomy_shares([r for r in results.w1 if r.k == 0]),
               "speculative": anatomy_shares([r for r in results.w1 if r.k is None and r.temperature == 0]),
               "speculative, sampled": anatomy_shares([r for r in results.w1 if r.k is None and r.temperature > 0])}
    for k in sorted({r.k for r in results.k_sweep if r.k is not None}):
        anatomy[f"K={k}"] = anatomy_shares([r for r in results.k_sweep if r.k == k])
    return Summary(
        greedy=greedy, sampled=sampled, alpha=alpha, alpha_source=source, alpha_by_position=conditional,
        accepted_by_position=unconditional, startup=startup, online=online, side_by_side=side_by_side,
        cost_batch=cost_batch, num_speculative_tokens=cap,
        best_k=best_k, expected=expected, efficiency=_ratio(greedy.speedup, expected),
        hf_plain=hf_plain, hf_assisted=hf_assisted,
        hf_matches_ours=_ratio(sum(checked), len(checked)) if checked else math.nan,
        vs_hf_assisted=_ratio(greedy.speculative.median, hf_assisted.median),
        vs_hf_plain=_ratio(greedy.plain.median, hf_plain.median),
        k_rows=_k_rows(results.k_sweep, headline.expected_by_k),
        concurrency=_concurrency_rows(results.concurrency), anatomy=anatomy,
        methods=method_rows(results.methods), method_targets=method_targets(results.methods),
        first_second=summarize_first_second(results.first_second) if results.first_second is not None else None,
        vs_fixed_k=vs_fixed_k(results.w1, temperature, results.concurrency),
        burst=summarize_burst(results.burst) if results.burst is not None else None,
        structured=summarize_structured(results.structured, _cpu(results.meta.get("machine", {})))
        if results.structured is not None else None,
    )


def _cpu(machine: dict[str, object]) -> str:
    return f"{machine.get('cpu_model', '?')}, {machine.get('cpus', '?')} logical CPUs"
