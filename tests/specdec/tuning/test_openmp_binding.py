"""A model service's OpenMP threads bound one per core (`bind_threads_before_torch`), checked
in a fresh interpreter as a service's `__main__` runs it: the thread that runs the forward
stays on the first core, each worker of a new team (after a release) starts on the next, and
the main thread, the threads it starts later and child processes are left unbound."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

# The service's layout: torch work on a worker thread started by the main thread after loading.
_CHECK = textwrap.dedent("""
    import json, os, sys, threading
    from concurrent.futures import ThreadPoolExecutor
    from specdec.tuning.thread_placement import OPENMP_BINDING_VARIABLES, bind_threads_before_torch

    applied = bind_threads_before_torch(sys.argv[1:])
    import torch
    from specdec.tuning.openmp import proc_bind, release_threads

    def masks() -> dict[int, list[int]]:
        return {int(tid): sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}

    def forward() -> dict[str, object]:
        torch.set_num_threads(2)
        x = torch.arange(1 << 22, dtype=torch.float32)
        x.mul(2).sum()  # a parallel region: the team exists
        first = masks()
        release_threads()
        x.mul(2).sum()  # a new team
        return {"worker": threading.get_native_id(), "first": first, "second": masks(), "policy": proc_bind()}

    result = ThreadPoolExecutor(1).submit(forward).result()
    result.update(applied=applied, main=threading.get_native_id(), main_mask=sorted(os.sched_getaffinity(0)),
                  env={name: os.environ.get(name) for name in OPENMP_BINDING_VARIABLES})
    print(json.dumps(result))
""")

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding needs two cores")


def run(*argv: str, env: dict[str, str] | None = None) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    out = subprocess.run([sys.executable, "-c", _CHECK, *argv], capture_output=True, text=True, timeout=120,
                         check=True, env={**environ, **(env or {})})
    return json.loads(out.stdout.splitlines()[-1])


def bound_threads(masks: dict[str, list[int]]) -> dict[int, list[int]]:
    """Threads allowed fewer CPUs than the machine gives (a core's, or its hyperthreads')."""
    every = sorted(os.sched_getaffinity(0))
    return {int(tid): mask for tid, mask in masks.items() if mask != every}


def test_forward_thread_and_each_new_worker_get_a_core_of_their_own() -> None:
    cores = sorted(os.sched_getaffinity(0))
    result = run("--threads", "2")
    assert result["applied"] == {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"} and result["policy"] == "close"
    for team in (result["first"], result["second"]):
        bound = bound_threads(team)
        forward = bound.pop(result["worker"])  # the thread running the forward: the first core
        assert cores[0] in forward and len(bound) == 1  # its one worker, on a core of its own
        assert not set(forward) & set(*bound.values())
    assert set(bound_threads(result["first"])) != set(bound_threads(result["second"]))  # a new worker
    assert result["main_mask"] == cores  # the main thread (and what it starts later) is free
    assert result["env"] == {"OMP_PROC_BIND": None, "OMP_PLACES": None}  # children start unbound


def test_cpu_cores_choose_the_places() -> None:
    cores = sorted(os.sched_getaffinity(0))
    result = run("--cpu-cores", f"{cores[1]},{cores[0]}")
    bound = bound_threads(result["first"])
    assert bound.pop(result["worker"]) == [cores[0]] and list(bound.values()) == [[cores[1]]]


def test_no_bind_threads_and_the_operators_variables_leave_threads_free() -> None:
    for result in (run("--no-bind-threads"), run(env={"OMP_PROC_BIND": "false"})):
        assert result["applied"] == {} and result["policy"] == "false"
        assert bound_threads(result["first"]) == {} and bound_threads(result["second"]) == {}
