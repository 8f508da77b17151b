"""`specdec health` and `specdec generate` start without torch or transformers.

Health checks run the one every few seconds; the other is a client. Importing the full
command line takes seconds (the model services' configs import torch), so both are
dispatched before it (`specdec.cli.main`), and their modules must stay light.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers")


@pytest.mark.parametrize("command", ["health", "generate"])
def test_a_client_command_imports_no_model_library(command: str) -> None:
    # The dispatch itself, as `specdec COMMAND --help` runs it: argparse exits after the help.
    probe = (
        "import sys\n"
        "from specdec.cli import main\n"
        "try:\n"
        f"    main([{command!r}, '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print('loaded:' + ','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: specdec" in done.stdout, "the probe did not run the command's parser"
    loaded = done.stdout.rsplit("loaded:", 1)[1].strip()
    assert loaded == "", f"`specdec {command}` imported {loaded}"
