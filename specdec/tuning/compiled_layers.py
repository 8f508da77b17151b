"""Decoding's short forwards (steps, verifies, guessed forwards) with their decoder layers
under `torch.compile`, where that measures faster.

A 1-token step of a small model is mostly small ops (RMSNorm, RoPE, the cache write and
gather, softmax, SiLU), each its own kernel launch between the matmuls. Compiled, the ops
between two matmuls become one generated kernel, and a group of up to ten layers runs as one
call (on the CPU with a C++ wrapper: `compile_options`). Whether that pays depends on the CPU
(or GPU), its compiler and the model, so "auto" compiles, times both paths side by side and
keeps the faster. On CUDA the uncompiled path replays its steps from CUDA graphs (which a
compiled step gives up), so that is what a compiled step is timed against. Compilation
that fails (no C++ compiler, an op the compiler does not know on this device) leaves the
model eager with a warning. An int4 draft on a CPU may serve these
forwards with one native call instead (`specdec.model.native_steps`, also decided by timing);
the graphs are built and timed with it set aside (`layers_only`).

One function runs a group of `layers_per_call` consecutive layers with their weights among
its inputs, so one graph serves every group. Only decoding's shapes are compiled (a
prompt's prefill stays eager), one graph per shape class (`SHAPES`), with the context length
(and a batch's size) dynamic: a single request's 1-token step, its 2-token round opening
(the last draft token and the bonus token after a fully accepted round), the same two for
a batch (rows of 1 and 2 tokens padded to 2), and forwards of 3 to 17 tokens a request,
single and batched, with the width dynamic too (a verify, or a drawn token fed with
guessed ones: `specdec.draft_server.engine`). A single request keeps its own graphs: with
the batch size dynamic its step ran slower. Each graph costs as much start-up as the first,
so further shapes are built only while `--compile-budget-s` lasts; inductor's on-disk cache
makes a restart's graphs cheap, and the decisions themselves are kept in the tuning cache
(`specdec.tuning.startup`), so a restart times nothing.

The graph has no guards on the layers' modules (their attributes are fixed once the model is
built); once warmed up, calls also skip dynamo's guards on Python values
(`skip_guard_eval_unsafe`) and check only those on tensors, which tell the graphs apart.
Timings behind these rules: docs/performance.md#compiled-draft-layers,
#compiled-guessed-forwards and #compiled-target-layers.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.kv_cache.paged_cache import PagedKVCache
from specdec.model.attention import ContextLayout
from specdec.model.choices import COMPILE_MODES, DEFAULT_COMPILE_BUDGET_S
from specdec.model.llama import LayerInputs, PagedLlama
from specdec.model.step_shapes import (
    MANY,
    MULTI,
    SHAPES,
    Shape,
    built_width,
    shape_class,
    shape_key,
    shape_name,
)
from specdec.tuning.cost_profile import filler_prompt
from specdec.tuning.timing import device_clock, interleaved_times, synchronizer

log = logging.getLogger(__name__)

#: The most decoder layers one compiled call runs: fewer, larger calls save the compiled
#: region's per-call cost, while each layer in a group adds compile time.
MAX_LAYERS_PER_COMPILED_CALL = 10
#: What dynamo's error says when a call under `skip_guard_eval_unsafe` matches no compiled graph.
GUARD_SKIP_MISS = "skip_guard_eval_unsafe"
#: Context the timed steps attend to (a short chat prompt plus some output).
TIMING_CONTEXT = 128
#: Contexts of the warm-up steps: the first compiles (context length dynamic), the second
#: runs a new length through that graph.
WARM_UP_CONTEXTS = (TIMING_CONTEXT - 1, TIMING_CONTEXT)
#: Requests in the batch steps that warm up and time the batch graphs: the warm-up runs 2
#: (the graph is built with the batch size dynamic) and then 3 through it, the timing all.
BATCH_SLOTS = 3
#: Interleaved timed steps per path and shape.
TIMING_REPEATS = 9
#: "auto" keeps a shape compiled only when its step is at least this much faster so.
MIN_GAIN = 0.05
_SLOT_PREFIX = "\x00compile-"  # never a gateway slot id: those are printable

def layers_per_compiled_call(num_layers: int, limit: int = MAX_LAYERS_PER_COMPILED_CALL) -> int:
    """The largest group size, at most `limit`, that divides `num_layers`: equal groups share
    one compiled graph (30 layers: 10; 16: 8; 28: 7; a prime count above the limit: 1)."""
    return max(size for size in range(1, min(limit, num_layers) + 1) if num_layers % size == 0)


def compile_options(device: torch.device) -> dict[str, str | int | bool | Callable[..., Any]]:
    """`torch.compile` options of the layer groups: no guards on the layers' modules (fixed
    once the model is built) and, on the CPU only, a C++ wrapper around the generated
    kernels, which saves a group's per-call Python cost there; on CUDA it would need the
    CUDA headers at run time, which a slim image lacks."""
    return {
        "cpp_wrapper": device.type == "cpu",
        "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
    }


class CompiledLayers:
    """A `PagedLlama`'s layer runner: the decoder layers through one compiled group function for
    the shape classes in `shapes`, eager for every other forward. Nothing is compiled until
    the first call of a shape with `compile_on_miss` set."""

    def __init__(self, model: PagedLlama, layers_per_call: int = 0) -> None:
        self.model = model
        self.layers_per_call = layers_per_call or layers_per_compiled_call(len(model.layers))
        self.group: Callable[..., torch.Tensor] = torch.compile(
            model.layer_group, options=compile_options(model.embed_tokens.weight.device)
        )
        #: Shape classes (`shape_class`) whose layers run compiled.
        self.shapes: set[Shape] = set()
        #: Whether a call that no compiled graph covers compiles one (warm-up) or runs eager (serving).
        self.compile_on_miss = False
        #: Pools whose K/V tensors are already marked dynamic in their row count.
        self._dynamic_pools: weakref.WeakSet[PagedKVCache] = weakref.WeakSet()

    def compiles(self, requests: int, width: int) -> bool:
        return shape_class(requests, width) in self.shapes

    def step_names(self) -> tuple[str, ...]:
        return tuple(shape_name(shape) for shape in sorted(self.shapes))

    def __call__(self, hidden: torch.Tensor, inputs: LayerInputs, cache: PagedKVCache) -> torch.Tensor:
        """The layers of one forward. Warmed up (`compile_on_miss` off), a call runs under
        `skip_guard_eval_unsafe`; one that fits no graph makes dynamo raise before anything ran,
        and then runs with the full guard check, eager where no graph covers it."""
        if (shape_class(hidden.shape[0], hidden.shape[1]) not in self.shapes
                or inputs.attention.layout is not ContextLayout.MASKED):  # a 1- or 2-token prompt
            return self.model.eager_layers(hidden, inputs, cache)
        self._mark_dynamic(hidden, inputs, cache)
        layers, step = self.model.layers, self.layers_per_call
        skip_guards = not self.compile_on_miss
        for start in range(0, len(layers), step):
            group = slice(start, start + step)
            args = (tuple(layers[group]), hidden, inputs, tuple(cache.kv[group]))
            if skip_guards:
                try:
                    with torch.compiler.set_stance("eager_on_recompile", skip_guard_eval_unsafe=True):
                        hidden = self.group(*args)
                    continue
                except RuntimeError as error:  # raised before the graph ran: nothing was written
                    if GUARD_SKIP_MISS not in str(error):
                        raise
                    skip_guards = False
            with torch.compiler.set_stance("default" if self.compile_on_miss else "eager_on_recompile"):
                hidden = self.group(*args)
        return hidden

    def _mark_dynamic(self, hidden: torch.Tensor, inputs: LayerInputs, cache: PagedKVCache) -> None:
        """One graph for every context length L, every pool size, for a batch every batch size
        and for the MULTI classes every width. A pool's tensors live on, so they are marked
        once, not on every call."""
        torch._dynamo.mark_dynamic(inputs.attention.context_index, 1)
        torch._dynamo.mark_dynamic(inputs.attention.bias, 3)
        if hidden.shape[0] >= MANY:
            for tensor in (hidden, *inputs.tensors()):
                torch._dynamo.mark_dynamic(tensor, 0)
        if hidden.shape[1] >= MULTI:  # the width: hidden [B, T, h], cos/sin [B, T, 1, D], bias [B, 1, T, L], rows [w]
            for tensor, dim in ((hidden, 1), (inputs.cos, 1), (inputs.sin, 1), (inputs.attention.bias, 2),
                                (inputs.write_index, 0), (inputs.kv_rows, 0)):
                torch._dynamo.mark_dynamic(tensor, dim)
        if cache not in self._dynamic_pools:
            for kv in cache.kv:
                torch._dynamo.mark_dynamic(kv, 0)
            self._dynamic_pools.add(cache)


def compiled_step_names(forward: PagedLlama) -> tuple[str, ...]:
    """The steps `forward` runs compiled, by name (empty when it runs eager)."""
    runner = forward.layer_runner
    return runner.step_names() if isinstance(runner, CompiledLayers) else ()


def compiled_pays(eager_s: float, compiled_s: float) -> bool:
    """Whether a shape runs compiled: its compiled step is at least `MIN_GAIN` faster."""
    return compiled_s < (1 - MIN_GAIN) * eager_s


def times_detail(key: str, eager_s: float, compiled_s: float, forward: PagedLlama) -> str:
    """One timed shape for the start-up log line; the uncompiled path is "graphs" where
    `forward` replays its steps from CUDA graphs."""
    baseline = "eager" if forward.step_graphs is None else "graphs"
    return f"{key} {baseline} / compiled {eager_s * 1e3:.1f} / {compiled_s * 1e3:.1f} ms"


@dataclass
class LayerPath:
    """What `choose_layer_path` decided."""

    #: The runner now installed on the model (None: eager, nothing compiled).
    runner: CompiledLayers | None
    #: Per shape class (`shape_key`): True to run compiled, False to stay eager; shapes over
    #: the budget are absent (a later start may build them).
    decisions: dict[str, bool] = field(default_factory=dict)
    #: Whether anything was timed here (False: every decision came from `known` or the mode).
    measured: bool = False
    #: Seconds spent building graphs.
    compile_s: float = 0.0
    #: Median seconds of each timed shape's step (`shape_key`), eager and compiled.
    times: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return "compiled" if self.runner is not None and self.runner.shapes else "eager"


def choose_layer_path(
    forward: PagedLlama,
    cache: PagedKVCache,
    mode: str,
    budget_s: float = DEFAULT_COMPILE_BUDGET_S,
    *,
    known: Mapping[str, bool] | None = None,
    runner: CompiledLayers | None = None,
) -> LayerPath:
    """Install on `forward` the layer runner `mode` asks for and return what was decided.

    "off" keeps eager without compiling; "on" compiles and keeps every shape that compiled;
    "auto" compiles, times each new shape's step both ways and keeps the shapes where compiled
    is faster. `known` holds earlier decisions (the tuning cache): a shape known to stay eager
    is not built, one known to run compiled is built but not timed. The first shape built is
    always built; each further one only while the graphs before took at most `budget_s`
    seconds. `runner` reuses an existing compiled function (its graphs). Uses (and afterwards
    frees) temporary slots in `cache`.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"mode must be one of {COMPILE_MODES}, got {mode!r}")
    forward.layer_runner = forward.eager_layers
    known = dict(known or {}) if mode == "auto" else {}
    wanted = [shape for shape in SHAPES if known.get(shape_key(shape), True)]
    if mode == "off" or not wanted:
        return LayerPath(None, {shape_key(s): False for s in SHAPES if shape_key(s) in known})
    if not has_room(cache):
        log.warning("decoder layers not compiled: a KV pool of %d tokens is too small to time it",
                    cache.capacity_tokens)
        return LayerPath(None)
    runner = runner or CompiledLayers(forward)
    runner.shapes = set()
    with layers_only(forward), step_slots(forward, cache) as step:
        forward.layer_runner = runner
        compile_s = _build_graphs(runner, wanted, step, budget_s)
        new = sorted(shape for shape in runner.shapes if shape_key(shape) not in known)
        decisions = {shape_key(shape): known.get(shape_key(shape), True) for shape in runner.shapes}
        times = _time_both_paths(forward, runner, new, step) if mode == "auto" and new else {}
        decisions.update({key: compiled_pays(eager, compiled) for key, (eager, compiled) in times.items()})
    runner.shapes = {shape for shape in runner.shapes if decisions[shape_key(shape)]}
    decisions.update({shape_key(s): False for s in SHAPES if shape_key(s) in known and not known[shape_key(s)]})
    if not runner.shapes:
        forward.layer_runner = forward.eager_layers
    return LayerPath(runner, decisions, measured=bool(times), compile_s=compile_s, times=times)


def load_graphs(
    runner: CompiledLayers, cache: PagedKVCache, shapes: list[Shape], *, timed: bool = False
) -> dict[str, tuple[float, float]] | None:
    """Build (from inductor's cache, when warm) the graphs of `shapes` and add each to
    `runner.shapes`, with no budget; with `timed`, also time each built shape's step eager and
    compiled (`shape_key` -> seconds, as `LayerPath.times`). None, with nothing done, while
    `cache` has no room for the warm-up slots (try again later)."""
    if not has_room(cache):
        return None
    with layers_only(runner.model), step_slots(runner.model, cache) as step:
        _build_graphs(runner, shapes, step, math.inf)
        built = [shape for shape in shapes if shape in runner.shapes]
        return _time_both_paths(runner.model, runner, built, step) if timed and built else {}


def has_room(cache: PagedKVCache) -> bool:
    """Whether the warm-up and timing slots fit in half of the pool's free tokens."""
    widest = max(built_width(shape) for shape in SHAPES)
    return cache.blocks.free_tokens >= 2 * BATCH_SLOTS * (TIMING_CONTEXT + widest + cache.block_size)


@contextmanager
def layers_only(forward: PagedLlama) -> Iterator[None]:
    """Every forward through the layer runner, none through `forward.step_runner` (a native
    step would otherwise take the 1-token steps that build and time their graphs)."""
    step_runner, forward.step_runner = forward.step_runner, None
    try:
        yield
    finally:
        forward.step_runner = step_runner


@contextmanager
def step_slots(forward: PagedLlama, cache: PagedKVCache) -> Iterator[Callable[..., None]]:
    """Temporary slots holding `TIMING_CONTEXT` tokens, and a function running one step on them:
    `step(requests, width, context)` rolls the first `requests` slots back to `context` tokens
    and feeds `width` more. The slots are freed afterwards."""
    prompt = filler_prompt(forward.vocab_size, TIMING_CONTEXT + max(built_width(shape) for shape in SHAPES))
    with cache.temporary_slots(_SLOT_PREFIX, BATCH_SLOTS) as slots:
        forward.run(cache, [(slot, prompt[:TIMING_CONTEXT]) for slot in slots])

        def step(requests: int, width: int, context: int = TIMING_CONTEXT) -> None:
            for slot in slots[:requests]:
                cache.blocks.truncate_to(slot, context)
            forward.run(cache, [(slot, prompt[context : context + width]) for slot in slots[:requests]], prompt=False)

        yield step


def timing_step(step: Callable[..., None], shape: Shape) -> Callable[[], None]:
    """The forward that times `shape`'s class on `step_slots`' slots: `BATCH_SLOTS` requests for
    a batch class, one otherwise, `built_width` tokens each."""
    return lambda: step(BATCH_SLOTS if shape[0] == MANY else 1, built_width(shape))


def _build_graphs(
    runner: CompiledLayers, shapes: list[Shape], step: Callable[..., None], budget_s: float
) -> float:
    """Build the graph of each of `shapes` by running its warm-up steps while `budget_s` lasts,
    adding it to `runner.shapes`; return the seconds spent. A batch warms up at 2 and then 3
    requests, so that its graph takes any batch size."""
    clock = device_clock(runner.model.embed_tokens.weight.device)
    started = clock()
    runner.compile_on_miss = True
    try:
        for shape in shapes:
            spent = clock() - started
            if runner.shapes and spent > budget_s:
                log.info("%s stay eager: the graphs before took %.1f s to build, over --compile-budget-s %.0f "
                         "(a restart loads them from the compile cache and builds the next)",
                         shape_name(shape), spent, budget_s)
                break
            requests, width = shape[0], built_width(shape)
            runner.shapes.add(shape)
            try:
                for extra, context in enumerate(WARM_UP_CONTEXTS):
                    step(requests + extra if requests == MANY else requests, width, context)
            except Exception as error:  # noqa: BLE001 - any compiler failure means: run that shape eager
                runner.shapes.discard(shape)
                log.warning("torch.compile of %s failed, running them eager: %s: %s",
                            shape_name(shape), type(error).__name__, error)
                break
    finally:
        runner.compile_on_miss = False
    return clock() - started


def _time_both_paths(
    forward: PagedLlama, runner: CompiledLayers, shapes: list[Shape], step: Callable[..., None]
) -> dict[str, tuple[float, float]]:
    """Median seconds of each shape's step (`shape_key`), eager and compiled, timed interleaved."""
    def setup(key: tuple[str, Shape]) -> None:
        forward.layer_runner = runner if key[0] == "compiled" else forward.eager_layers

    candidates = {
        (path, shape): timing_step(step, shape) for path in ("eager", "compiled") for shape in shapes
    }
    sync = synchronizer(forward.embed_tokens.weight.device)
    times = interleaved_times(candidates, repeats=TIMING_REPEATS, setup=setup, sync=sync)
    forward.layer_runner = runner
    return {shape_key(shape): (times[("eager", shape)], times[("compiled", shape)]) for shape in shapes}
