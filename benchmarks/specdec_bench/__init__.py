"""`specdec bench`: the speed harness of the three-process stack.

One run starts target, draft and gateway as separate processes (as `specdec serve` does),
measures single-request decode speed with and without speculation, transformers' own plain
and assisted generation on the same weights, fixed-K and concurrency sweeps, and the costs
the services measured themselves; then it writes a results JSON, PNG plots and a Markdown
page. Modules, in the order a run uses them:

- `command`: `specdec bench`, registered with the `specdec` command (entry point `specdec.commands`);
- `config`: `BenchConfig` (full and `--quick` presets) and its command-line flags;
- `stack`: start and stop the three services, read their Info and the gateway's metrics;
- `workloads`: the chat prompts and one measured request (`RunRecord`);
- `sweeps`: W1 (plain vs speculative, interleaved), the fixed-K and the concurrency sweeps;
- `peers`: transformers `generate`, plain and assisted, timed like ours;
- `first_second_run`, `first_second`: traffic from the first second, on fresh stacks (after the
  rest, or alone with `--first-second only`), and its records and figures;
- `structured_workload`, `structured_run`, `structured`, `structured_report`: the structured
  workload (`--structured-repetitions`): its prompts, schemas and answer check, the measurement,
  its records and figures, and its part of the page;
- `results`: the JSON document of one run;
- `spread`: median, extremes and quartiles of a sample;
- `analysis`: every derived figure (speedups, α, c, s, S(K), efficiency) from the JSON alone;
- `plots`, `report`: PNGs, the summary table, the final line and `docs/benchmarks.md`;
- `runner`: the whole run, with a progress bar.

The package lives in `benchmarks/specdec_bench/` and is installed under that name (see
pyproject.toml), so nothing generic named `benchmarks` lands in site-packages.
"""
