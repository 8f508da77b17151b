"""`specdec bench`, as the harness adds it to the `specdec` command.

pyproject.toml names `register` in the `specdec.commands` entry-point group, which the command
line reads (`specdec.cli.main`), so the library never imports the harness. Registering stays
light (the flags only): `specdec bench --help` imports neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from specdec.errors import SpecdecError
from specdec_bench.config import add_bench_flags, config_from_args


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `bench` to the `specdec` command's subcommands."""
    parser = commands.add_parser(
        "bench", help="measure speed: starts the trio, writes results JSON, plots and docs/benchmarks.md",
        description="Speed harness: W1 single requests (plain vs speculative), transformers' plain and assisted "
        "generate, fixed-K and concurrency sweeps, the services' measured costs. The last line printed is "
        "'speedup=… vs_hf_assisted=… efficiency=… alpha=… c=…'.",
    )
    add_bench_flags(parser)
    parser.set_defaults(run=bench)


def bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    try:
        config = config_from_args(args)
    except SpecdecError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:  # tqdm and matplotlib (the `bench` extra) load only when benchmarking
        from specdec_bench.runner import run
    except ModuleNotFoundError as error:
        print(f"error: specdec bench needs {error.name}: pip install -e '.[bench]'", file=sys.stderr)
        return 1
    return run(config, argv)
