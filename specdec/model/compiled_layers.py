"""Whether a single request's short steps run their decoder layers under `torch.compile`,
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

A second graph covers the 2-token step that opens a drafting round after a fully
accepted one (the last draft token and the target's bonus token). Eager, that step cost
1.5-1.9x a compiled 1-token step (AMD EPYC Zen 5: 7.6 vs 5.1 ms; Zen 3: 28-33 vs 15-20
ms); compiled, about the same as one (5.2 ms). Its graph costs start-up time (cold: 17 s
on the Zen 5 after the 1-token graph's 19 s; 44 s on the Zen 3, whose 1-token graph took
30-33 s), so it is built only when the 1-token graph was quick enough for start-up to
stay within about a minute.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

from specdec.kv_cache.paged_cache import PagedKVCache
from specdec.model.cost_profile import filler_prompt
from specdec.model.llama import PagedLlama

log = logging.getLogger(__name__)

COMPILE_MODES = ("auto", "on", "off")
#: Context the timed steps attend to (a short chat prompt plus some output).
TIMING_CONTEXT = 128
#: Contexts of the warm-up steps: the first compiles (context length dynamic), the second
#: runs a new length through that graph.
WARM_UP_CONTEXTS = (TIMING_CONTEXT - 1, TIMING_CONTEXT)
#: Chunk widths that get a graph, in order: a drafting step, then a round's opening feed.
WIDTHS = (1, 2)
#: A width after the first gets its graph only when the graphs so far took at most this
#: many seconds to build: each costs about as much again (see the module docstring).
MORE_WIDTHS_WITHIN_S = 25.0
#: Interleaved timed steps per path and width; each reports its median.
TIMING_REPEATS = 9
#: "auto" keeps a width compiled only when its step is at least this much faster so.
MIN_GAIN = 0.05
_SLOT_PREFIX = "\x00compile-"  # never a gateway slot id: those are printable


def choose_layer_path(forward: PagedLlama, cache: PagedKVCache, mode: str) -> str:
    """Set and return `forward`'s layer path ("compiled" or "eager"), and the chunk widths
    its compiled path covers (`forward.compiled_widths`), for `mode`.

    "off" keeps eager without compiling; "on" compiles and keeps every width that compiled;
    "auto" compiles, then times each width's step both ways and keeps the widths where
    compiled is faster (eager when none is). Uses (and afterwards frees) a temporary slot
    in `cache`.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"mode must be one of {COMPILE_MODES}, got {mode!r}")
    forward.set_layer_path("eager")
    forward.compiled_widths = set()
    if mode == "off":
        return "eager"
    if cache.blocks.free_tokens < 2 * (TIMING_CONTEXT + max(WIDTHS) + cache.block_size):  # leave half the pool free
        log.warning("decoder layers not compiled: a KV pool of %d tokens is too small to time it", cache.capacity_tokens)
        return "eager"
    prompt = filler_prompt(forward.vocab_size, TIMING_CONTEXT + max(WIDTHS))
    with cache.temporary_slots(_SLOT_PREFIX, 1) as (slot,):
        forward.run(cache, [(slot, prompt[:TIMING_CONTEXT])])

        def step(context: int, width: int) -> float:
            """Seconds of one `width`-token step whose first new token sits at position `context`."""
            cache.blocks.truncate_to(slot, context)
            started = time.perf_counter()
            forward.run(cache, [(slot, prompt[context : context + width])])
            return time.perf_counter() - started

        forward.compile_layers()
        forward.set_layer_path("compiled")
        compile_s = _compile_widths(forward, step)
        if not forward.compiled_widths:
            forward.set_layer_path("eager")
            return "eager"
        if mode == "on":
            log.info("decoder layers compiled (%d a call) for %s-token steps in %.1f s (--compile on)",
                     forward.layers_per_call, _widths(forward.compiled_widths), compile_s)
            return "compiled"
        times = _time_both_paths(forward, step)
    eager = {width: statistics.median(samples) for width, samples in times["eager"].items()}
    compiled = {width: statistics.median(samples) for width, samples in times["compiled"].items()}
    forward.compiled_widths = {width for width in compiled if compiled[width] < (1 - MIN_GAIN) * eager[width]}
    path = "compiled" if forward.compiled_widths else "eager"
    forward.set_layer_path(path)
    log.info(
        "decoder layers compiled (%d a call) in %.1f s; steps at %d tokens of context, eager / compiled: %s; "
        "running %s", forward.layers_per_call, compile_s, TIMING_CONTEXT,
        ", ".join(f"{w} token(s) {eager[w] * 1e3:.1f} / {compiled[w] * 1e3:.1f} ms" for w in sorted(eager)),
        f"compiled ({_widths(forward.compiled_widths)}-token steps)" if forward.compiled_widths else "eager",
    )
    return path


def _compile_widths(forward: PagedLlama, step: Callable[[int, int], float]) -> float:
    """Build the graph of each width in `WIDTHS` by running its steps (while the start-up
    budget lasts), adding it to `forward.compiled_widths`; return the seconds spent."""
    started = time.perf_counter()
    forward.compile_on_miss = True
    try:
        for width in WIDTHS:
            spent = time.perf_counter() - started
            if forward.compiled_widths and spent > MORE_WIDTHS_WITHIN_S:
                log.info("%d-token steps stay eager: the graphs before took %.1f s to build", width, spent)
                break
            forward.compiled_widths.add(width)
            try:
                for context in WARM_UP_CONTEXTS:
                    step(context, width)
            except Exception as error:  # noqa: BLE001 - any compiler failure means: run that width eager
                forward.compiled_widths.discard(width)
                log.warning("torch.compile of the %d-token step failed, running it eager: %s: %s",
                            width, type(error).__name__, error)
                break
    finally:
        forward.compile_on_miss = False
    return time.perf_counter() - started


def _time_both_paths(forward: PagedLlama, step: Callable[[int, int], float]) -> dict[str, dict[int, list[float]]]:
    """Seconds of each compiled width's step, eager and compiled, interleaved."""
    widths = sorted(forward.compiled_widths)
    times: dict[str, dict[int, list[float]]] = {path: {width: [] for width in widths} for path in ("eager", "compiled")}
    for _ in range(TIMING_REPEATS):
        for path, by_width in times.items():
            forward.set_layer_path(path)
            for width, samples in by_width.items():
                samples.append(step(TIMING_CONTEXT, width))
    return times


def _widths(widths: set[int]) -> str:
    return "/".join(str(width) for width in sorted(widths))
