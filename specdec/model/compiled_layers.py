"""Whether the drafting loop's short steps run their decoder layers under `torch.compile`,
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
stay within about a minute (`--compile-budget-s`).

A third graph covers a batch's 1-token step (two or more requests, the batch size
dynamic): eager, a step of 4 requests cost 11.4 ms against 8.3 ms compiled, and 8
requests 17.5 against 13.4 ms (AMD EPYC Zen 5, side by side). It costs as much start-up
again (20 s cold), so under the same rule a cold start builds it only where the first
two graphs were quick.

A fourth covers a batch's round-opening feed: rows whose last round was fully accepted
feed 2 tokens, the others 1, padded to one [B, 2] step. At 3 requests it took 20.6 ms
eager against 15.5 ms compiled (AMD EPYC Zen 4, start-up timing); through the stack (two
drafts, with and without it, each behind its own gateway on one target, 4 groups of
concurrent 128-token greedy requests alternating) fixed K = 8 ran 1.052×, 1.050× and
1.057× as fast at 2, 4 and 8 requests (pairwise medians), adaptive K 1.050× and 1.051× at
2 and 4 (0.98× and 1.01× at 8 and 16, where it mixes plain rounds in; ranges ±20 %). It
is built last, under the same rule. Restarts load the graphs from inductor's on-disk
cache in about 2 s each (see deployment), so a warm start builds all four.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

from specdec.kv_cache.paged_cache import PagedKVCache
from specdec.model.cost_profile import filler_prompt
from specdec.model.llama import MANY, PagedLlama

log = logging.getLogger(__name__)

COMPILE_MODES = ("auto", "on", "off")
#: Context the timed steps attend to (a short chat prompt plus some output).
TIMING_CONTEXT = 128
#: Contexts of the warm-up steps: the first compiles (context length dynamic), the second
#: runs a new length through that graph.
WARM_UP_CONTEXTS = (TIMING_CONTEXT - 1, TIMING_CONTEXT)
#: Shape classes (requests, tokens each) that get a graph, in order: a single request's
#: drafting step, its round-opening 2-token feed, then a batch's drafting step and its
#: round-opening feed (some rows 2 tokens, the others 1, padded to 2).
SHAPES = ((1, 1), (1, 2), (MANY, 1), (MANY, 2))
#: The default of `--compile-budget-s`: a shape after the first gets its graph only when
#: the graphs so far took at most this many seconds to build, since each costs about as
#: much again (see the module docstring).
DEFAULT_COMPILE_BUDGET_S = 25.0
#: Requests in the batch steps that warm up and time the batch graph: the warm-up runs 2
#: (the graph is built with the batch size dynamic) and then 3 through it, the timing all.
BATCH_SLOTS = 3
#: Interleaved timed steps per path and shape; each reports its median.
TIMING_REPEATS = 9
#: "auto" keeps a shape compiled only when its step is at least this much faster so.
MIN_GAIN = 0.05
_SLOT_PREFIX = "\x00compile-"  # never a gateway slot id: those are printable


def choose_layer_path(
    forward: PagedLlama, cache: PagedKVCache, mode: str, budget_s: float = DEFAULT_COMPILE_BUDGET_S
) -> str:
    """Set and return `forward`'s layer path ("compiled" or "eager"), and the shape classes
    its compiled path covers (`forward.compiled_shapes`), for `mode`.

    "off" keeps eager without compiling; "on" compiles and keeps every shape that compiled;
    "auto" compiles, then times each shape's step both ways and keeps the shapes where
    compiled is faster (eager when none is). The first shape is always built; each further
    one only while the graphs before took at most `budget_s` seconds. Uses (and afterwards
    frees) temporary slots in `cache`.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"mode must be one of {COMPILE_MODES}, got {mode!r}")
    forward.set_layer_path("eager")
    forward.compiled_shapes = set()
    if mode == "off":
        return "eager"
    widest = max(width for _, width in SHAPES)
    if cache.blocks.free_tokens < 2 * BATCH_SLOTS * (TIMING_CONTEXT + widest + cache.block_size):  # leave half the pool free
        log.warning("decoder layers not compiled: a KV pool of %d tokens is too small to time it", cache.capacity_tokens)
        return "eager"
    prompt = filler_prompt(forward.vocab_size, TIMING_CONTEXT + widest)
    with cache.temporary_slots(_SLOT_PREFIX, BATCH_SLOTS) as slots:
        forward.run(cache, [(slot, prompt[:TIMING_CONTEXT]) for slot in slots])

        def step(context: int, requests: int, width: int) -> float:
            """Seconds of one step of `requests` × `width` tokens, the first new token at position `context`."""
            for slot in slots[:requests]:
                cache.blocks.truncate_to(slot, context)
            started = time.perf_counter()
            forward.run(cache, [(slot, prompt[context : context + width]) for slot in slots[:requests]])
            return time.perf_counter() - started

        forward.compile_layers()
        forward.set_layer_path("compiled")
        compile_s = _compile_shapes(forward, step, budget_s)
        if not forward.compiled_shapes:
            forward.set_layer_path("eager")
            return "eager"
        if mode == "on":
            log.info("decoder layers compiled (%d a call) for %s in %.1f s (--compile on)",
                     forward.layers_per_call, ", ".join(compiled_step_names(forward)), compile_s)
            return "compiled"
        times = _time_both_paths(forward, step)
    eager = {shape: statistics.median(samples) for shape, samples in times["eager"].items()}
    compiled = {shape: statistics.median(samples) for shape, samples in times["compiled"].items()}
    forward.compiled_shapes = {shape for shape in compiled if compiled[shape] < (1 - MIN_GAIN) * eager[shape]}
    path = "compiled" if forward.compiled_shapes else "eager"
    forward.set_layer_path(path)
    log.info(
        "decoder layers compiled (%d a call) in %.1f s; steps at %d tokens of context, eager / compiled: %s; "
        "running %s", forward.layers_per_call, compile_s, TIMING_CONTEXT,
        ", ".join(f"{_name(shape)} {eager[shape] * 1e3:.1f} / {compiled[shape] * 1e3:.1f} ms" for shape in sorted(eager)),
        f"compiled ({', '.join(compiled_step_names(forward))})" if forward.compiled_shapes else "eager",
    )
    return path


def _timed_requests(shape: tuple[int, int]) -> int:
    """Requests in the timed steps of a shape class: all the slots for a batch."""
    return BATCH_SLOTS if shape[0] == MANY else 1


def _compile_shapes(forward: PagedLlama, step: Callable[[int, int, int], float], budget_s: float) -> float:
    """Build the graph of each shape in `SHAPES` by running its steps (while `budget_s`
    lasts), adding it to `forward.compiled_shapes`; return the seconds spent. A
    batch warms up at 2 and then 3 requests, so that its graph takes any batch size."""
    started = time.perf_counter()
    forward.compile_on_miss = True
    try:
        for shape in SHAPES:
            spent = time.perf_counter() - started
            if forward.compiled_shapes and spent > budget_s:
                log.info("%s stay eager: the graphs before took %.1f s to build, over --compile-budget-s %.0f "
                         "(a restart loads them from the compile cache and builds the next)", _name(shape), spent, budget_s)
                break
            requests, width = shape
            forward.compiled_shapes.add(shape)
            try:
                for extra, context in enumerate(WARM_UP_CONTEXTS):
                    step(context, requests + extra if requests == MANY else requests, width)
            except Exception as error:  # noqa: BLE001 - any compiler failure means: run that shape eager
                forward.compiled_shapes.discard(shape)
                log.warning("torch.compile of %s failed, running them eager: %s: %s",
                            _name(shape), type(error).__name__, error)
                break
    finally:
        forward.compile_on_miss = False
    return time.perf_counter() - started


def _time_both_paths(
    forward: PagedLlama, step: Callable[[int, int, int], float]
) -> dict[str, dict[tuple[int, int], list[float]]]:
    """Seconds of each compiled shape's step, eager and compiled, interleaved."""
    shapes = sorted(forward.compiled_shapes)
    times: dict[str, dict[tuple[int, int], list[float]]] = {
        path: {shape: [] for shape in shapes} for path in ("eager", "compiled")
    }
    for _ in range(TIMING_REPEATS):
        for path, by_shape in times.items():
            forward.set_layer_path(path)
            for shape, samples in by_shape.items():
                samples.append(step(TIMING_CONTEXT, _timed_requests(shape), shape[1]))
    return times


def compiled_step_names(forward: PagedLlama) -> tuple[str, ...]:
    """The steps `forward` runs compiled, by name (empty on the eager path)."""
    if forward.layer_path != "compiled":
        return ()
    return tuple(_name(shape) for shape in sorted(forward.compiled_shapes))


def _name(shape: tuple[int, int]) -> str:
    requests, width = shape
    who = "batch" if requests == MANY else "single-request"
    return f"{who} {width}-token steps"
