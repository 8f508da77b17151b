"""Whether a single request's 1-token step runs its decoder layers under `torch.compile`,
decided at start-up by measurement.

A 1-token step of a small model is mostly small ops: RMSNorm, RoPE, the cache write
and gather, softmax, SiLU, each a separate kernel launch between the matmuls. Compiled,
the ops between two matmuls become one generated kernel, and groups of up to ten layers
run as one call with a C++ wrapper. On an AMD EPYC (Zen 3, 2 cores, AVX2) the int4
draft's 1-token step at a 300-token context took 26.7 ms eager, 21.1 ms compiled one layer
a call, and 16.5 ms in groups of ten (side by side). Whether it pays elsewhere
depends on the CPU (or GPU), its compiler and the model, so "auto" compiles, times both
paths side by side and keeps the faster; compilation that fails (no C++ compiler, an op
the compiler does not know on this device) falls back to eager with a warning.
"""

from __future__ import annotations

import logging
import statistics
import time

from specdec.kv_cache.paged_cache import PagedKVCache
from specdec.model.cost_profile import filler_prompt
from specdec.model.llama import PagedLlama

log = logging.getLogger(__name__)

COMPILE_MODES = ("auto", "on", "off")
#: Context the timed 1-token steps attend to (a short chat prompt plus some output).
TIMING_CONTEXT = 128
#: Contexts of the warm-up steps: the first compiles (context length dynamic), the second
#: runs a new length through that graph.
WARM_UP_CONTEXTS = (TIMING_CONTEXT - 1, TIMING_CONTEXT)
#: Interleaved timed steps per path; each path reports its median.
TIMING_REPEATS = 9
#: "auto" keeps the compiled path only when it is at least this much faster.
MIN_GAIN = 0.05
_SLOT_PREFIX = "\x00compile-"  # never a gateway slot id: those are printable


def choose_layer_path(forward: PagedLlama, cache: PagedKVCache, mode: str) -> str:
    """Set and return `forward`'s layer path ("compiled" or "eager") for `mode`.

    "off" keeps eager without compiling; "on" compiles and keeps it (unless compiling
    fails); "auto" compiles, then times a 1-token step both ways and keeps the faster.
    Uses (and afterwards frees) a temporary slot in `cache`.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"mode must be one of {COMPILE_MODES}, got {mode!r}")
    forward.set_layer_path("eager")
    if mode == "off":
        return "eager"
    if cache.blocks.free_tokens < 2 * (TIMING_CONTEXT + 1 + cache.block_size):  # leave half the pool free
        log.warning("decoder layers not compiled: a KV pool of %d tokens is too small to time it", cache.capacity_tokens)
        return "eager"
    prompt = filler_prompt(forward.vocab_size, TIMING_CONTEXT + 1)
    with cache.temporary_slots(_SLOT_PREFIX, 1) as (slot,):
        forward.run(cache, [(slot, prompt[:TIMING_CONTEXT])])

        def step(context: int) -> float:
            """Seconds of one 1-token step whose new token sits at position `context`."""
            cache.blocks.truncate_to(slot, context)
            started = time.perf_counter()
            forward.run(cache, [(slot, prompt[context : context + 1])])
            return time.perf_counter() - started

        forward.compile_layers()
        forward.set_layer_path("compiled")
        started = time.perf_counter()
        forward.compile_on_miss = True
        try:
            for context in WARM_UP_CONTEXTS:
                step(context)
        except Exception as error:  # noqa: BLE001 - any compiler failure means: serve eager
            forward.set_layer_path("eager")
            log.warning("torch.compile of the decoder layers failed, running eager: %s: %s", type(error).__name__, error)
            return "eager"
        finally:
            forward.compile_on_miss = False
        compile_s = time.perf_counter() - started
        if mode == "on":
            log.info("decoder layers compiled (%d a call) in %.1f s (--compile on)", forward.layers_per_call, compile_s)
            return "compiled"
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(TIMING_REPEATS):
            for path, samples in times.items():
                forward.set_layer_path(path)
                samples.append(step(TIMING_CONTEXT))
    eager, compiled = (statistics.median(times[path]) for path in ("eager", "compiled"))
    path = "compiled" if compiled < (1 - MIN_GAIN) * eager else "eager"
    forward.set_layer_path(path)
    log.info(
        "decoder layers compiled (%d a call) in %.1f s; 1-token step at %d tokens of context: eager %.1f ms, compiled %.1f ms: running %s",
        forward.layers_per_call, compile_s, TIMING_CONTEXT, eager * 1e3, compiled * 1e3, path,
    )
    return path
