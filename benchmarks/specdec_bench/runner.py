"""One whole benchmark run: start the stack, measure with a progress bar, write and print.

The last line printed (stdout) is the headline, machine-readable:
`speedup=… vs_hf_assisted=… efficiency=… alpha=… c=…`; with `--first-second only`, the
scenario's: `first_second_vs_plain=… first_second_vs_waited=… startup_to_drafting_s=…`.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from tqdm import tqdm
from transformers.utils import logging as hf_logging

from specdec.client import SpecdecClient
from specdec_bench import analysis, plots, report
from specdec_bench.burst_run import measure_burst
from specdec_bench.config import BenchConfig
from specdec_bench.first_second_run import measure_first_second
from specdec_bench.peers import METHODS, run_peers
from specdec_bench.results import BenchResults, ServiceCosts, machine
from specdec_bench.stack import Stack, running_stack
from specdec_bench.step_timing import StepPair, probe_steps
from specdec_bench.structured import StructuredMode
from specdec_bench.structured_run import measure_structured
from specdec_bench.structured_workload import STRUCTURED_PROMPTS
from specdec_bench.sweeps import (
    ExactnessError,
    Progress,
    concurrency_sweep,
    k_sweep,
    method_comparison,
    w1,
    warm_up,
    warm_up_methods,
)
from specdec_bench.workloads import REQUEST_TIMEOUT_S, DraftMethod, RunRecord, Workload


def repo_root() -> Path:
    """The checkout this package was installed from (editable install), else the working directory."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() else Path.cwd()


def resolve(path: str) -> Path:
    """Relative paths in the config are relative to the repository root."""
    p = Path(path)
    return p if p.is_absolute() else repo_root() / p


def _planned_runs(config: BenchConfig) -> int:
    modes = 2 + len(config.fixed_k)  # plain, speculative and each fixed K
    w1_runs = config.repetitions * config.prompts * 2 * modes  # greedy and sampled
    peer_runs = config.peer_repetitions * config.prompts * len(METHODS)
    sweep_runs = config.sweep_prompts * (config.max_k + 1) if config.max_k else 0
    workload_prompts = sum(len(w.prompts(config.workload_chat_prompts)) for w in Workload)
    method_runs = config.workload_repetitions * workload_prompts * len(DraftMethod)
    structured_runs = config.structured_repetitions * (len(STRUCTURED_PROMPTS) + 1) * len(StructuredMode)
    return (w1_runs + peer_runs + sweep_runs + method_runs + structured_runs
            + modes * config.concurrency_repetitions * len(config.concurrency))


@dataclass
class Laps:
    """Wall seconds per phase of the run, for the results' meta."""

    seconds: dict[str, float] = field(default_factory=dict)
    _mark: float = field(default_factory=time.monotonic)

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.seconds[name] = round(now - self._mark, 1)
        self._mark = now


def measure(config: BenchConfig, command: str) -> BenchResults:
    """Start the stack, run every measurement and return the results (raises ExactnessError)."""
    started = time.monotonic()
    laps = Laps()
    with tqdm(total=_planned_runs(config), unit="run", file=sys.stderr, dynamic_ncols=True) as progress:
        progress.set_description("starting services")
        with running_stack(*config.service_args(), lookup_gateway=config.workload_repetitions > 0) as stack:
            laps.lap("start_services")
            with SpecdecClient(stack.address, timeout=REQUEST_TIMEOUT_S) as client:
                costs = ServiceCosts.from_info(client.info())
                config = within_services(config, costs)
                progress.set_description("warming up")
                warm_up(client, config.max_k)
                laps.lap("warm_up")
                step_pairs: list[StepPair] = []
                vocab_size = client.info().target.vocab_size

                def probe(rep: int) -> None:
                    step_pairs.extend(probe_steps(stack.target.address, stack.draft.address, vocab_size, rep))

                outcome = w1(client, config, progress, between=probe)
                probe(config.repetitions)
                laps.lap("w1")
                peers = run_peers(
                    stack.target_config, stack.draft_config, prompts=config.prompts,
                    max_new_tokens=config.max_new_tokens, k=costs.default_num_speculative_tokens,
                    repetitions=config.peer_repetitions, reference=outcome.greedy_tokens, progress=progress,
                ) if config.peer_repetitions else []
                laps.lap("peers")
                sweep = k_sweep(client, stack, config, progress) if config.max_k else []
                laps.lap("k_sweep")
                methods = measure_methods(client, stack, config, progress)
                laps.lap("methods")
                groups = concurrency_sweep(client, config, progress)
                laps.lap("concurrency")
                structured = None
                if config.structured_repetitions:
                    structured = measure_structured(client, stack, config, progress)
                laps.lap("structured")
                burst = measure_burst(client, config, progress) if config.burst_s else None
                laps.lap("burst")
            services = {"target": dataclasses.asdict(stack.target_config),
                        "draft": dataclasses.asdict(stack.draft_config)}
        laps.lap("stop_services")
        # After the stack above stopped: never two stacks at once.
        first_second = measure_first_second(config, command, progress) if config.first_second == "on" else None
        laps.lap("first_second")
        progress.set_description("done")
    meta = {
        "command": command,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "duration_s": time.monotonic() - started,
        "phase_s": laps.seconds,
        "machine": machine(),
        "config": dataclasses.asdict(config),
        "services": services,
    }
    return BenchResults(meta, costs, outcome.records, peers, sweep, groups, step_pairs, methods, first_second, burst,
                        structured)


def within_services(config: BenchConfig, costs: ServiceCosts) -> BenchConfig:
    """`config` with the sweep's largest K and the fixed Ks cut to what the services accept."""
    limit = costs.max_speculative_tokens
    fixed = tuple(k for k in config.fixed_k if k <= limit)
    if fixed != config.fixed_k:
        print(f"--fixed-k: the services take at most K = {limit}; dropped "
              f"{','.join(str(k) for k in config.fixed_k if k > limit)}", file=sys.stderr)
    return dataclasses.replace(config, max_k=min(config.max_k, limit), fixed_k=fixed)


def measure_methods(client: SpecdecClient, stack: Stack, config: BenchConfig, progress: Progress) -> list[RunRecord]:
    """The drafting-method comparison (none when `workload_repetitions` is 0)."""
    if not config.workload_repetitions:
        return []
    with SpecdecClient(stack.lookup_address, timeout=REQUEST_TIMEOUT_S) as lookup_client:
        warm_up_methods(client, lookup_client)
        return method_comparison(client, lookup_client, config, progress)


def render(results: BenchResults, config: BenchConfig) -> analysis.Summary:
    """Summary, plots and (unless --docs '') the Markdown page, all from `results`."""
    summary = analysis.summarize(results)
    drawn = plots.draw_all(summary, resolve(config.plots_dir))
    if config.docs:
        docs = resolve(config.docs)
        docs.parent.mkdir(parents=True, exist_ok=True)
        docs.write_text(report.render_page(results, summary, drawn, docs, resolve(config.results)))
    return summary


def run(config: BenchConfig, argv: Sequence[str]) -> int:
    """`specdec bench`: measure (unless --render-only), write, print the table and the final line."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # the services' weight-loading bars
    hf_logging.disable_progress_bar()  # and the peers' (transformers is already imported here)
    results_path = resolve(config.results)
    if config.render_only:
        results = BenchResults.load(results_path)
    elif config.first_second == "only":
        if not results_path.is_file():
            print(f"error: --first-second only adds to an earlier run's results, and {results_path} does not "
                  "exist: run the bench first or point --results at its JSON", file=sys.stderr)
            return 1
        results = BenchResults.load(results_path)
        try:
            with tqdm(unit="request", file=sys.stderr, dynamic_ncols=True) as progress:
                results.first_second = measure_first_second(config, "specdec " + shlex.join(argv), progress)
        except (RuntimeError, TimeoutError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        results.save(results_path)
    else:
        hf_logging.set_verbosity_error()  # generate()'s advisory warnings would break the progress bar
        try:
            results = measure(config, "specdec " + shlex.join(argv))
        except ExactnessError as error:
            print(f"\n*** {error} ***", file=sys.stderr)
            return 2
        except (RuntimeError, TimeoutError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        results.save(results_path)  # before rendering, so a plotting failure loses no measurement
    summary = render(results, config)
    results.save(results_path, summary=dataclasses.asdict(summary))
    written = [str(results_path), str(resolve(config.plots_dir))] + ([str(resolve(config.docs))] if config.docs else [])
    print(f"results: {', '.join(written)}", file=sys.stderr)
    if config.first_second == "only" and summary.first_second is not None:
        print(f"first second, on {summary.first_second.cpu}:", file=sys.stderr)
        print(report.first_second_table(summary.first_second))
        print(summary.first_second.final_line())
        return 0
    print(report.summary_table(summary))
    if summary.first_second is not None:
        print(report.first_second_table(summary.first_second))
    print(summary.final_line())
    return 0
