"""Run a block of torch work on one intra-op thread."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the block's torch ops on one intra-op thread (switching is cheap).

    For small ops with many synchronisation points, which two threads speed up little
    when the cores are free and slow down badly when another process holds one
    (docs/performance.md#one-thread-for-small-ops). The start-up kernel choices time on one
    thread for the same reason: with two, the other process's stalls enter the comparison,
    while per-core speed alone ranks the kernels.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
