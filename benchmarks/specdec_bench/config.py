"""What one benchmark run measures, with a full and a `--quick` preset, and its flags.

Every flag comes from a `BenchConfig` field (help text in the field's metadata). A flag
left unset takes the preset's value, so `specdec bench --quick --max-new-tokens 64` is the
quick run with longer generations.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field

from specdec.errors import InvalidArgumentError
from specdec_bench.structured_workload import STRUCTURED_PROMPTS
from specdec_bench.workloads import PROMPTS

#: Fewest prompts a run uses (W1 medians over fewer would say little).
MIN_PROMPTS = 5
#: The draft's `--compile-budget-s` in a run: enough to build every compiled graph cold.
BENCH_COMPILE_BUDGET_S = 600.0
#: `--first-second`: skip the scenario / run it after the rest / run it alone.
FIRST_SECOND_MODES = ("off", "on", "only")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run. The defaults are the full run; `QUICK` is `--quick`."""

    quick: bool = field(default=False, metadata=_help(
        "the quick preset: fewer prompts, repetitions and tokens (minutes on 2 cores)"))
    prompts: int = field(default=6, metadata=_help(f"chat prompts of W1 and the peers ({MIN_PROMPTS}..{len(PROMPTS)})"))
    max_new_tokens: int = field(default=128, metadata=_help("new tokens per W1, peer and K-sweep request"))
    repetitions: int = field(default=3, metadata=_help(
        "W1 repetitions of every prompt (plain and speculative interleaved)"))
    temperature: float = field(default=0.8, metadata=_help(
        "the sampled W1 variant's temperature (fixed seed per prompt)"))
    seed: int = field(default=1234, metadata=_help("seed of the sampled requests (prompt i uses seed + i)"))
    peer_repetitions: int = field(default=2, metadata=_help(
        "repetitions of transformers' generate, plain and assisted (0 = skip)"))
    max_k: int = field(default=8, metadata=_help("the fixed-K sweep runs K = 0..max_k (0 = skip the sweep)"))
    sweep_prompts: int = field(default=3, metadata=_help("prompts of the fixed-K sweep"))
    concurrency: tuple[int, ...] = field(default=(1, 2, 4, 8, 16), metadata=_help(
        "concurrency levels, comma-separated (empty = skip)"))
    concurrency_tokens: int = field(default=128, metadata=_help("new tokens per request of the concurrency sweep"))
    concurrency_repetitions: int = field(default=3, metadata=_help(
        "repetitions of every concurrency level (plain and speculative alternating; medians reported)"))
    fixed_k: tuple[int, ...] = field(default=(), metadata=_help(
        "fixed Ks (adaptive off) that W1 and the concurrency sweep run too, interleaved with plain and adaptive "
        "K, comma-separated: adaptive K is compared with the best of them and plain in hindsight (empty = none)"))
    burst_s: float = field(default=20.0, metadata=_help(
        "a CPU burst of this many seconds (two busy processes) amid greedy single requests, after the rest of "
        "the stack's measurements, one pass speculative and one plain (20 s before, 30 s after each): how soon "
        "each is back to its earlier speed (0 = skip)"))
    structured_repetitions: int = field(default=0, metadata=_help(
        f"repetitions of the structured workload ({len(STRUCTURED_PROMPTS)} prompts: extraction to a schema, tool "
        "calls, an enum-heavy triage; greedy): each prompt alone and one group of 16 at once per repetition, "
        "constrained speculative, constrained plain, constrained speculative without grammar drafts (a second "
        "gateway, --no-grammar-drafts), unconstrained speculative and plain, interleaved; 2 gives 56 constrained "
        "requests per mode, ~10 min on 2 cores (0 = skip)"))
    structured_tokens: int = field(default=96, metadata=_help(
        "most new tokens of a constrained request of the structured workload (an unconstrained one gets as many "
        "as the prompt's constrained plain answer had)"))
    workload_repetitions: int = field(default=2, metadata=_help(
        "repetitions of the drafting-method comparison on the copy-heavy, long-context and chat workloads "
        "(methods interleaved per prompt; 0 = skip)"))
    workload_tokens: int = field(default=128, metadata=_help("new tokens per request of the method comparison"))
    workload_chat_prompts: int = field(default=6, metadata=_help(
        f"chat prompts of the method comparison (1..{len(PROMPTS)})"))
    cost_batch: int = field(default=4, metadata=_help("batch size B of the second verify-slope figure s(B)"))
    target_args: str = field(default="", metadata=_help(
        "extra flags for `python -m specdec.target_server`, e.g. --target-args='--dtype bfloat16'"))
    draft_args: str = field(default="", metadata=_help(
        "extra flags for `python -m specdec.draft_server`, e.g. --draft-args='--quantization int4'"))
    gateway_args: str = field(default="", metadata=_help(
        "extra flags for `python -m specdec.gateway`, e.g. --gateway-args='--num-speculative-tokens 6'"))
    results: str = field(default="benchmarks/results/bench.json", metadata=_help(
        "results JSON (relative paths: from the repo root)"))
    plots_dir: str = field(default="docs/benchmarks", metadata=_help("folder of the PNG plots"))
    docs: str = field(default="docs/benchmarks.md", metadata=_help("Markdown page to write ('' = none)"))
    render_only: bool = field(default=False, metadata=_help(
        "measure nothing: redraw the plots and the page from --results"))
    first_second: str = field(default="on", metadata={**_help(
        "traffic from the first second: two fresh stacks, one after the other, are sent W1's greedy chat requests "
        "one at a time for --first-second-span-s each, one from the moment its gateway answers, the other after "
        "its services loaded their compiled graphs (then plain and speculative alternate); takes 2 × the span "
        "plus two start-ups and the waited stack's graph loading: 6-8 min at 90 s on 2 cores, more on a busy "
        "machine or from cold caches. 'on': after the rest of the "
        "run; 'only': alone, replacing the scenario in the --results JSON of an earlier run, whose page is "
        "redrawn"), "choices": FIRST_SECOND_MODES})
    first_second_span_s: float = field(default=90.0, metadata=_help(
        "seconds of traffic per stack of the first-second scenario"))
    first_second_window_s: float = field(default=60.0, metadata=_help(
        "the first-second scenario's figures count the requests that start this many seconds after a stack's "
        "traffic began or later (t + this for the stack sent traffic from the first second)"))
    first_second_settle_s: float = field(default=5.0, metadata=_help(
        "the first-second scenario's waited stack idles this long after its graphs loaded"))

    def __post_init__(self) -> None:
        if not MIN_PROMPTS <= self.prompts <= len(PROMPTS):
            raise InvalidArgumentError(f"prompts must be in [{MIN_PROMPTS}, {len(PROMPTS)}], got {self.prompts}")
        if not 1 <= self.workload_chat_prompts <= len(PROMPTS):
            raise InvalidArgumentError(
                f"workload_chat_prompts must be in [1, {len(PROMPTS)}], got {self.workload_chat_prompts}")
        if not 1 <= self.sweep_prompts <= len(PROMPTS):
            raise InvalidArgumentError(f"sweep_prompts must be in [1, {len(PROMPTS)}], got {self.sweep_prompts}")
        for name in ("max_new_tokens", "repetitions", "concurrency_tokens", "concurrency_repetitions", "cost_batch"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be >= 1, got {getattr(self, name)}")
        if min(self.max_new_tokens, self.concurrency_tokens, self.workload_tokens, self.structured_tokens) < 2:
            raise InvalidArgumentError("decode speed needs at least 2 new tokens per request")
        for name in ("peer_repetitions", "max_k", "workload_repetitions", "structured_repetitions"):
            if getattr(self, name) < 0:
                raise InvalidArgumentError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.temperature <= 0:
            raise InvalidArgumentError(f"temperature must be > 0 (the greedy variant always runs), "
                                       f"got {self.temperature}")
        if any(k < 1 for k in self.fixed_k):
            raise InvalidArgumentError(f"fixed_k values must be >= 1 (plain always runs), got {self.fixed_k}")
        if not self.burst_s >= 0:
            raise InvalidArgumentError(f"burst_s must be >= 0, got {self.burst_s}")
        if any(level < 1 for level in self.concurrency):
            raise InvalidArgumentError(f"concurrency levels must be >= 1, got {self.concurrency}")
        if not self.results:
            raise InvalidArgumentError("results: a path is required")
        if self.first_second not in FIRST_SECOND_MODES:
            raise InvalidArgumentError(f"first_second must be one of {', '.join(FIRST_SECOND_MODES)}, "
                                       f"got {self.first_second!r}")
        if not 0 <= self.first_second_window_s < self.first_second_span_s:
            raise InvalidArgumentError(f"first_second_window_s must be in [0, first_second_span_s = "
                                       f"{self.first_second_span_s:g}), got {self.first_second_window_s:g}")
        if not self.first_second_settle_s >= 0:
            raise InvalidArgumentError(f"first_second_settle_s must be >= 0, got {self.first_second_settle_s}")
        if self.render_only and self.first_second == "only":
            raise InvalidArgumentError("render_only measures nothing: it cannot run the first-second scenario alone")

    def service_args(self) -> tuple[str, str, str]:
        """Extra flags of the target, the draft and the gateway of every stack a run starts."""
        # Prompts computed in full: W1 and the sweeps repeat every prompt, and with the prefix
        # cache on, every repeat after the first would skip both prefills (flags given later win).
        cold = "--no-prefix-caching"
        # Every compiled graph, as a service started from a warm compile cache has them.
        all_graphs = f"--compile-budget-s {BENCH_COMPILE_BUDGET_S:.0f}"
        return f"{cold} {self.target_args}", f"{cold} {all_graphs} {self.draft_args}", self.gateway_args


FULL = BenchConfig()
#: Two W1 repetitions: a 48-token speculative request is ~6 rounds and ~0.7 s, and on a shared
#: VM identical requests (same rounds, same acceptance) ran 62-82 tok/s within one run (AMD
#: EPYC Zen 4), so one median of 5 moved the headline speedup and efficiency by ±10 %. The
#: second adds ~30 s (2:07 → ~2:40 there).
QUICK = BenchConfig(
    quick=True, prompts=5, max_new_tokens=48, repetitions=2, peer_repetitions=1, sweep_prompts=1,
    concurrency=(1, 4, 16), concurrency_tokens=32, concurrency_repetitions=1,
    workload_repetitions=1, workload_tokens=48, workload_chat_prompts=2, first_second="off", burst_s=0.0,
    results="benchmarks/results/quick/bench.json", plots_dir="benchmarks/results/quick",
    docs="benchmarks/results/quick/benchmarks.md",
)


def _int_tuple(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _shown(value: object) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "''"
    return repr(value) if isinstance(value, str) else str(value)


def add_bench_flags(parser: argparse.ArgumentParser) -> None:
    """One `--flag` per `BenchConfig` field; unset flags keep the chosen preset's value."""
    hints = typing.get_type_hints(BenchConfig)
    for f in dataclasses.fields(BenchConfig):
        flag = f"--{f.name.replace('_', '-')}"
        full, quick = getattr(FULL, f.name), getattr(QUICK, f.name)
        if hints[f.name] is bool:
            parser.add_argument(flag, action="store_true", default=None, help=f.metadata["help"])
            continue
        shown = _shown(full) if full == quick else f"{_shown(full)}, quick: {_shown(quick)}"
        kind = _int_tuple if hints[f.name] == tuple[int, ...] else hints[f.name]
        parser.add_argument(flag, type=kind, default=None, choices=f.metadata.get("choices"),
                            help=f"{f.metadata['help']} (default: {shown})")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The preset `--quick` selects, with every flag that was given applied on top."""
    preset = QUICK if args.quick else FULL
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(BenchConfig)
             if getattr(args, f.name) is not None}
    return dataclasses.replace(preset, **given)
