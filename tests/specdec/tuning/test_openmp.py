"""Releasing the OpenMP threads between forwards (`specdec.tuning.openmp`): the workers
really exit, and the next forward runs with its full team and the same numbers."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap

from specdec.flags import add_flags, from_args
from specdec.serving.config import ModelServiceConfig

# Runs in a fresh interpreter: nothing else there starts or stops threads meanwhile.
_CHECK = textwrap.dedent("""
    import os, time, torch
    from specdec.tuning.openmp import release_threads

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    torch.set_num_threads(3)
    x = torch.arange(1 << 22, dtype=torch.float32)
    want = x.mul(2).sum()  # a parallel region: the team of 3 (2 workers) now exists
    with_team = threads()
    assert release_threads(), "libgomp did not release its threads"
    deadline = time.monotonic() + 60  # the loop ends as soon as the workers have exited
    while threads() > with_team - 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    released = threads()
    got = x.mul(2).sum()  # a new team
    print(with_team, released, threads(), torch.get_num_threads(), bool(torch.equal(want, got)))
""")


def test_released_workers_exit_and_the_next_forward_gets_a_new_team() -> None:
    out = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=120, check=True)
    with_team, released, after, num_threads, same = out.stdout.split()
    assert int(released) == int(with_team) - 2  # both workers gone, the caller stays
    assert int(after) == int(with_team) and num_threads == "3" and same == "True"


def test_releasing_is_on_by_default_and_a_flag_turns_it_off() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, ModelServiceConfig)
    assert from_args(ModelServiceConfig, parser.parse_args([])).release_threads
    assert not from_args(ModelServiceConfig, parser.parse_args(["--no-release-threads"])).release_threads
