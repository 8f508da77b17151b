"""Run a block of torch work on one intra-op thread."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the block's torch ops on one intra-op thread (switching costs ~0.2 µs).

    For small ops with many synchronisation points, which two threads speed up little
    when the cores are free and slow down badly when another process holds one: sampling
    eight top-p rows of a 49k vocabulary took 14 ms on two threads and 27 ms on one with
    the cores free, but 200 ms against 39 ms while a second process computed on both
    cores (AMD EPYC Zen 5); a single row takes 3.4 ms either way. The start-up kernel
    choices time on one thread for the same reason: with two, the other process's stalls
    enter the comparison, while per-core speed alone ranks the kernels.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
