"""`specdec bench` comes from the harness: registered through an entry point, never imported by
the command line, and an installation without it says how to get it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from specdec.cli.main import COMMAND_GROUP, main
from specdec_bench.command import bench, register
from specdec_bench.config import QUICK, config_from_args

ROOT = Path(__file__).resolve().parents[3]


def test_pyproject_registers_the_harness_command() -> None:
    tomllib = pytest.importorskip("tomllib")
    entry_points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert entry_points[COMMAND_GROUP] == {"bench": "specdec_bench.command:register"}


def test_register_adds_bench_with_its_flags_and_its_run() -> None:
    parser = argparse.ArgumentParser(prog="specdec")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "--quick"])
    assert args.run is bench and config_from_args(args) == QUICK


def test_without_the_harness_bench_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys.modules["specdec.cli.main"], "entry_points", lambda group: [])
    assert main(["bench", "--quick"]) == 1
    assert "pip install -e '.[bench]'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # other commands still refuse unknown flags
        main(["serve", "--no-such-flag"])
