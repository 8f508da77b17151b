"""The command line starts without torch or transformers until it serves or benchmarks.

Health checks run `specdec health` every few seconds, `specdec generate` and `specdec info`
are clients, and every `--help` should answer at once: importing torch and transformers takes
seconds. The model services' configs take their choices from `specdec.model.choices`, which
imports neither, and the gateway loads inside `specdec serve`.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers")


@pytest.mark.parametrize("command", ["health", "generate", "info", "serve", "bench", None])
def test_a_commands_help_imports_no_model_library(command: str | None) -> None:
    # The dispatch itself, as `specdec COMMAND --help` runs it: argparse exits after the help.
    probe = (
        "import sys\n"
        "from specdec.cli import main\n"
        "try:\n"
        f"    main({[command, '--help'] if command else ['--help']!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print('loaded:' + ','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: specdec" in done.stdout, "the probe did not run the command's parser"
    loaded = done.stdout.rsplit("loaded:", 1)[1].strip()
    assert loaded == "", f"`specdec {command or ''} --help` imported {loaded}"
