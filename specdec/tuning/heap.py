"""Keep freed memory in the process: every call of a model service allocates the same
large tensors again, and glibc's default hands them back to the kernel at each free.

glibc's malloc serves a large block with its own `mmap` and unmaps it when freed, and gives
the top of its heap back once more than 128 KB of it is free. A tensor of a few MB — a
Verify's logits [K + 1, vocab] are 1.7 MB at K = 8 over SmolLM2's 49,152 tokens, 38 MB at
K = 8 over Llama 3's 128,256 — then costs a page fault per 4 KB page each time it is
written anew (docs/performance.md#freed-memory-kept).

`retain_freed_memory` raises both thresholds (`mallopt`), the fix PyTorch's CPU tuning guide
reaches for with jemalloc or tcmalloc, without another library. A process's resident memory
then stays at its high-water mark instead of shrinking between calls, which is what a
long-running service does anyway. A no-op, with a log line, where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

#: `mallopt` parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: Blocks below this come from the heap, not from their own mmap: glibc's largest allowed
#: value on 64-bit systems.
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
#: Free memory at the heap's top is given back only beyond this much.
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024


def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where that is not possible."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        log.info("freed memory: left to the C library's defaults (no glibc mallopt)")
        return False
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if ok:
        log.info("freed memory: kept in the process (blocks up to %d MB from the heap, trimmed past %d MB free)",
                 MMAP_THRESHOLD_BYTES >> 20, TRIM_THRESHOLD_BYTES >> 20)
    else:
        log.warning("freed memory: mallopt refused the thresholds; left to the C library's defaults")
    return ok
