"""Where a model service's threads run: its OpenMP threads bound one per core, set before torch loads.

The draft and the target take turns on the same cores, and each lets its OpenMP threads go
when it hands the cores over (`specdec.tuning.openmp`), so every Propose and every Verify of
draft tokens starts a new thread team. Left to the kernel, a new worker thread often starts
on the core its creator is running on, and the two share that core for several scheduler
ticks while the other core idles (docs/performance.md#openmp-threads-between-calls). Bound
(`OMP_PROC_BIND=close`, `OMP_PLACES=cores`), the thread that runs the forward stays on the
first core and each worker starts on a core of its own.

libgomp reads those two variables once, as it loads with torch, so a service's `__main__`
calls `bind_threads_before_torch` before anything imports torch. Loading also binds the
loading (main) thread to the first core; that is undone at once, so the event loop and the
gRPC threads, which the main thread starts later, run on any core. The variables are then
removed from the environment again, so child processes (inductor's compile workers) start
unbound. An `OMP_PROC_BIND` or `OMP_PLACES` of the operator's own wins: nothing is set then.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specdec.errors import InvalidArgumentError
from specdec.flags import add_flags, from_args, option

#: What `bind_threads_before_torch` sets; the operator's own setting of either wins.
OPENMP_BINDING_VARIABLES = ("OMP_PROC_BIND", "OMP_PLACES")


@dataclass(frozen=True)
class ThreadPlacement:
    """The model services' flags for where their threads run (validated by the service config)."""

    bind_threads: bool = option(
        True, "bind the forward pass's OpenMP threads one per core (OMP_PROC_BIND=close, OMP_PLACES=cores or "
        "--cpu-cores), set as the service starts; an OMP_PROC_BIND or OMP_PLACES in the environment wins",
    )
    cpu_cores: str = option(
        "", "pin the service to these CPU cores, e.g. 0 or 0-1, with one intra-op thread per core unless --threads "
        "says otherwise (empty = no pinning)",
    )


def parse_cores(spec: str) -> set[int]:
    """CPU core numbers from "0,2" or "0-3" (empty: none); InvalidArgumentError when malformed."""
    cores: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise InvalidArgumentError(f"cpu_cores: {part!r} is not a core number or range",
                                       field="cpu_cores") from None
        if not 0 <= first <= last:
            raise InvalidArgumentError(f"cpu_cores: {part!r} is not a valid range", field="cpu_cores")
        cores.update(range(first, last + 1))
    return cores


def openmp_binding(placement: ThreadPlacement, environ: Mapping[str, str]) -> dict[str, str]:
    """The OpenMP variables that bind `placement`'s threads ({} when binding is off or the
    environment already sets either variable). Places are the given cores, else every core."""
    if not placement.bind_threads or any(name in environ for name in OPENMP_BINDING_VARIABLES):
        return {}
    cores = sorted(parse_cores(placement.cpu_cores))
    places = ",".join(f"{{{core}}}" for core in cores) if cores else "cores"
    return {"OMP_PROC_BIND": "close", "OMP_PLACES": places}


def bind_threads_before_torch(argv: Sequence[str]) -> dict[str, str]:
    """Read `--bind-threads` and `--cpu-cores` from `argv`, then load torch with the OpenMP
    binding they ask for. Returns the variables it applied ({} when none: binding off, set
    by the operator, torch already loaded, or no CPU affinity calls on this OS). Malformed
    flags are left to the service's own parse, which reports them."""
    if "torch" in sys.modules or not hasattr(os, "sched_getaffinity"):  # too late, or not Linux
        return {}
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_flags(parser, ThreadPlacement)
    try:
        placement = from_args(ThreadPlacement, parser.parse_known_args(list(argv))[0])
        binding = openmp_binding(placement, os.environ)
    except (argparse.ArgumentError, InvalidArgumentError):
        return {}
    if not binding:
        return {}
    mask = os.sched_getaffinity(0)
    os.environ.update(binding)
    try:
        import torch  # noqa: F401  (libgomp loads with it, reads the binding and binds this thread)
    finally:
        for name in binding:
            del os.environ[name]
        os.sched_setaffinity(0, mask)
    return binding
