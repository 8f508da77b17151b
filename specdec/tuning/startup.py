"""The seam for start-up choices: each made once, from a flag, the tuning cache or a
measurement, recorded with its reason, and the measured ones saved for the next start.

The runtime builder and the engine call `StartupTuner`; one log line (`StartupTuner.line`)
and `ModelInfo.tuning` report what it chose. The measurements live beside it (`kernels`,
`compiled_layers`, `cost_profile`); the model code takes the choices as arguments.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from specdec.cost_model import ForwardCost
from specdec.kv_cache.paged_cache import PagedKVCache
from specdec.model.attention import default_kernel, make_attention
from specdec.model.choices import INT4_KERNELS, AttentionKernel
from specdec.model.linear import DenseLinear, onednn_available
from specdec.model.llama import PagedLlama
from specdec.model.loader import default_cache_dir, weights_fingerprint
from specdec.model.native_steps import NATIVE_SHAPES, NativeSteps
from specdec.model.native_steps import unsupported as native_unsupported
from specdec.model.quantize import Int8Linear
from specdec.model.quantize_int4 import Int4Linear
from specdec.model.shortlist_head import ShortlistHead
from specdec.tuning.choices import TuningChoice, tuning_line
from specdec.tuning.compiled_layers import (
    SHAPES,
    CompiledLayers,
    Shape,
    choose_layer_path,
    compiled_pays,
    compiled_step_names,
    load_graphs,
    shape_key,
    shape_name,
    times_detail,
)
from specdec.tuning.cost_profile import forward_cost_steps, measure_forward_costs, one_token_step, step_seconds
from specdec.tuning.kernels import measure_dense, measure_head, measure_int4_kernels, measure_int4_wide
from specdec.tuning.native_steps import native_detail, native_pays, time_native_steps
from specdec.tuning.store import TuningKey, TuningStore, code_version, machine_fingerprint

log = logging.getLogger(__name__)

JSON = Any
#: A cached cost table is timed again where this machine's 1-token step is this many times
#: faster than the table says: tables timed beside a busy test run came out 4-17x too slow.
STALE_TABLE_FACTOR = 1.5


def _ms(times: Mapping[str, float]) -> str:
    return ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in times.items())


class StartupTuner:
    """Makes and records a service's start-up choices; with a `store` and a `key` it reuses and
    keeps its measurements."""

    def __init__(self, store: TuningStore | None = None, key: TuningKey | None = None) -> None:
        self.store, self.key = store, key
        self._cached: dict[str, JSON] = store.load(key) if store is not None and key is not None else {}
        #: What the next start may reuse: every value measured or reused now.
        self.values: dict[str, JSON] = {}
        self.choices: list[TuningChoice] = []
        #: Whether anything was timed at this start (then it is saved).
        self.measured = False
        #: The compiled layer runner installed by `layer_path`, if any.
        self.runner: CompiledLayers | None = None
        #: Whether `layer_path` may leave graphs whose decisions are all cached to
        #: `load_pending` (the service calls it after it started serving).
        self.defer_graphs = True
        #: Shape classes whose graphs load after start-up (`load_pending`): those decided
        #: compiled, and those not decided yet, which are timed once loaded.
        self.pending: list[Shape] = []
        #: The native runner `native_steps` built, and per shape class (`shape_key`) whether it
        #: serves it; the classes kept against eager forwards at start-up, to be timed against
        #: their compiled graphs once loaded (`load_pending`).
        self.native_runner: NativeSteps | None = None
        self.native_decisions: dict[str, bool] = {}
        self.native_unconfirmed: set[str] = set()
        #: What `load_pending` timed, for the log.
        self.loaded_detail: list[str] = []
        self._steps: tuple[str, ...] | None = None

    @classmethod
    def for_service(
        cls, *, model: str, dtype: str, quantization: str, device: str, settings: Mapping[str, object],
        reuse: bool = True,
    ) -> StartupTuner:
        """A tuner keyed by everything the measurements depend on (this machine, torch, the
        model and its weights, dtype, quantization, device, thread count, code, `settings`);
        one without the cache when `reuse` is off."""
        if not reuse:
            return cls()
        key = TuningKey(
            machine=machine_fingerprint(device), torch=torch.__version__, model=model,
            weights=weights_fingerprint(model), dtype=dtype, quantization=quantization, device=device,
            threads=torch.get_num_threads(), code=code_version(),
            settings=",".join(f"{name}={value}" for name, value in sorted(settings.items())),
        )
        return cls(TuningStore(default_cache_dir() / "tuning"), key)

    def note(self, name: str, value: object, reason: str, detail: str = "") -> None:
        """Record a choice (`specdec.tuning.choices.REASONS`)."""
        self.choices.append(TuningChoice(name, str(value), reason, detail))

    def decide(
        self, name: str, measure: Callable[[], tuple[JSON, str]], valid: Callable[[JSON], bool] = lambda _: True
    ) -> tuple[JSON, str, str]:
        """The cached value of `name` where there is a `valid` one, else `measure()`'s (value,
        detail); returns (value, reason, detail) and keeps the value for the next start."""
        cached = self._cached.get(name)
        if cached is not None and valid(cached):
            self.values[name] = cached
            return cached, "cached", ""
        value, detail = measure()
        self.values[name], self.measured = value, True
        return value, "measured", detail

    def line(self) -> str:
        return tuning_line(self.choices)

    def save(self) -> None:
        """Keep this start's measurements for the next one (nothing to write when all were reused)."""
        if self.store is not None and self.key is not None and self.measured:
            self.store.save(self.key, self.values)

    # -- the choices, in the order a service makes them --------------------------------

    def int4_kernel(self, kernel: str, device: str, dtype: torch.dtype) -> str:
        """The int4 kernel to prefer ("" when `kernel` names one: the flag decides)."""
        if kernel != "auto":
            self.note("int4_kernel", kernel, "flag")
            return ""
        if torch.device(device).type != "cpu":
            self.note("int4_kernel", "dequant", "fixed", "the only int4 kernel off CPU")
            return "dequant"

        def measure() -> tuple[str, str]:
            times = measure_int4_kernels(dtype)
            return min(times, key=times.__getitem__), f"1 thread: {_ms(times)}"

        chosen, reason, detail = self.decide("int4_kernel", measure, lambda value: value in INT4_KERNELS)
        self.note("int4_kernel", chosen, reason, detail)
        return str(chosen)

    def output_head(self, exact: Int8Linear, shortlist: int, kernel: str, prefer: str) -> nn.Module:
        """`exact`, or a `ShortlistHead` over it where that is faster (`shortlist` 0: never)."""
        if shortlist <= 0:
            self.note("output_head", "int8", "flag")
            return exact
        cached = self._cached.get("output_head")
        if cached == "int8":  # nothing to build
            self.values["output_head"] = cached
            self.note("output_head", "int8", "cached")
            return exact
        candidate = ShortlistHead.from_int8(exact, min(shortlist, exact.out_features), kernel=kernel, prefer=prefer)

        def measure() -> tuple[str, str]:
            times = measure_head(exact, candidate)
            return min(times, key=times.__getitem__), f"1 + 4 rows, 1 thread: {_ms(times)}"

        chosen, reason, detail = self.decide("output_head", measure, lambda value: value in ("int8", "shortlist"))
        self.note("output_head", chosen if chosen == "int8" else f"shortlist of {candidate.shortlist}", reason, detail)
        return candidate if chosen == "shortlist" else exact

    def dense_kernels(self, forward: PagedLlama) -> None:
        """Set every dense projection's kernels for narrow and wide inputs, per weight shape."""
        modules = [m for layer in forward.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        dense = [m for m in [*modules, forward.lm_head] if isinstance(m, DenseLinear)]
        if not dense:
            self.note("dense_kernels", "none", "fixed", "no dense projections")
            return
        if not onednn_available(dense[0].weight):
            self.note("dense_kernels", "aten", "fixed", "no oneDNN linear for this device and dtype")
            return
        shapes = {f"{m.out_features}x{m.in_features}": m for m in dense}

        def measure() -> tuple[dict[str, list[str]], str]:
            return {shape: list(measure_dense(m.weight)) for shape, m in shapes.items()}, ""

        def valid(value: JSON) -> bool:
            return isinstance(value, dict) and set(value) == set(shapes)

        chosen, reason, _ = self.decide("dense_kernels", measure, valid)
        for m in dense:
            m.set_kernels(*chosen[f"{m.out_features}x{m.in_features}"])
        summary = ", ".join(f"{shape} {'/'.join(kernels)}" for shape, kernels in chosen.items())
        self.note("dense_kernels", "narrow/wide per shape", reason, summary)

    def int4_wide_kernels(self, forward: PagedLlama) -> None:
        """Per int4 weight shape, whether wide inputs (a prompt or a catch-up) leave the 4-bit
        kernel for a dense matmul on the dequantized weight, at the cost of keeping it."""
        modules = [m for layer in forward.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        int4 = [m for m in modules if isinstance(m, Int4Linear)]
        if not int4:
            return
        device, dtype = forward.embed_tokens.weight.device, forward.dtype
        if device.type != "cpu":
            self.note("int4_wide_kernel", "dequant", "fixed", "the only int4 kernel off CPU")
            return
        shapes = {f"{m.out_features}x{m.in_features}": m for m in int4}

        def measure() -> tuple[dict[str, str], str]:
            times = {shape: measure_int4_wide(m, dtype) for shape, m in shapes.items()}
            detail = "; ".join(f"{shape} {_ms(t)}" for shape, t in times.items())
            return {shape: min(t, key=t.__getitem__) for shape, t in times.items()}, detail

        def valid(value: JSON) -> bool:
            return isinstance(value, dict) and set(value) == set(shapes) and set(value.values()) <= set(INT4_KERNELS)

        chosen, reason, detail = self.decide("int4_wide_kernels", measure, valid)
        for m in int4:
            kernel = str(chosen[f"{m.out_features}x{m.in_features}"])
            m.set_wide_kernel("" if kernel == m.prepare(device, dtype) else kernel)
        summary = ", ".join(f"{shape} {kernel}" for shape, kernel in chosen.items())
        self.note("int4_wide_kernel", "per shape", reason, f"{summary} ({detail})" if detail else summary)

    def attention(self, forward: PagedLlama, flag: str) -> None:
        """Set the attention kernel: the one `flag` names, or for "auto" the device's default."""
        if flag != "auto":
            kernel, reason, detail = AttentionKernel(flag), "flag", ""
        else:
            device = forward.embed_tokens.weight.device
            kernel, reason, detail = default_kernel(device), "fixed", f"the default on {device.type}"
        forward.attention = make_attention(kernel)
        self.note("attention", kernel.value, reason, detail)

    def layer_path(self, forward: PagedLlama, cache: PagedKVCache, mode: str, budget_s: float, measure: bool) -> None:
        """Install the compiled layer runner where `mode` and the measurements say so."""
        if mode == "auto" and not measure:
            mode = "off"  # "auto" decides by timing: a service told not to measure stays eager
        cached = self._cached.get("compiled_steps") if mode == "auto" else None
        known = cached if isinstance(cached, dict) and all(isinstance(v, bool) for v in cached.values()) else None
        if known and self.defer_graphs:
            self._defer(forward, known)
            self._publish(forward)
            return
        chosen = choose_layer_path(forward, cache, mode, budget_s, known=known, runner=self.runner)
        self.runner = chosen.runner
        self._publish(forward)
        steps = ", ".join(self.compiled_steps(forward)) or "none"
        if mode != "auto":
            self.note("compiled_steps", steps, "flag", f"--compile {mode}")
            return
        self.values["compiled_steps"] = chosen.decisions
        self.measured |= chosen.measured
        detail = ", ".join(times_detail(key, *times, forward) for key, times in chosen.times.items())
        if chosen.compile_s:
            detail = f"graphs built in {chosen.compile_s:.1f} s" + (f", {detail}" if detail else "")
        self.note("compiled_steps", steps, "measured" if chosen.measured else "cached", detail)

    def native_steps(self, forward: PagedLlama, cache: PagedKVCache, mode: str, measure: bool) -> None:
        """Install the native call for the shape classes where `mode` and the measurements say
        so: "auto" times each class against the layer path installed now (`layer_path` first).
        A class kept against eager forwards whose compiled graph loads later is provisional
        until `load_pending` has timed it against that graph (`specdec.tuning.native_steps`)."""
        why = native_unsupported(forward) if mode != "off" else "--native-steps off"
        if why:
            self.note("native_steps", "none", "flag" if mode == "off" else "fixed", why)
            return
        if mode == "auto" and not measure:
            self.note("native_steps", "none", "flag", "--no-measure-costs: nothing is timed")
            return
        self.native_runner = NativeSteps(forward)
        keys = [shape_key(shape) for shape in NATIVE_SHAPES]
        cached = self._cached.get("native_steps")
        if mode == "on":
            decisions, reason, detail = dict.fromkeys(keys, True), "flag", ""
        elif isinstance(cached, dict) and set(cached) == set(keys) and all(type(v) is bool for v in cached.values()):
            decisions, reason, detail = {key: bool(kept) for key, kept in cached.items()}, "cached", ""
            self.values["native_steps"] = decisions
        else:
            times = time_native_steps(forward, cache, self.native_runner)
            decisions, reason, self.measured = native_pays(times), "measured", True
            detail = native_detail(times) or "no room in the KV pool to time it"
            pending = {shape_key(shape) for shape in self.pending}
            self.native_unconfirmed = {key for key, kept in decisions.items() if kept and key in pending}
            if self.native_unconfirmed:
                detail += "; timed again against the compiled graphs as they load"
            elif times:
                self.values["native_steps"] = decisions
        self.native_decisions = decisions
        self._install_native(forward)
        self.note("native_steps", ", ".join(shape_name(shape) for shape in sorted(self.native_runner.shapes)) or "none",
                  reason, detail)

    def _install_native(self, forward: PagedLlama) -> None:
        """The native runner on `forward` for the classes decided native (none: no runner)."""
        runner = self.native_runner
        if runner is not None:
            runner.shapes = {shape for shape in NATIVE_SHAPES if self.native_decisions.get(shape_key(shape))}
            forward.step_runner = runner if runner.shapes else None

    def _confirm_native(self, forward: PagedLlama, cache: PagedKVCache, shapes: list[Shape], compiled: bool) -> None:
        """`shapes` have their compiled graphs now (`compiled`), or never will: time a
        provisional native call against its graph and keep the faster, or keep it as it was
        timed against eager; once every class is settled keep the decisions for the next start."""
        if not self.native_unconfirmed:
            return
        for shape in shapes:
            key = shape_key(shape)
            if key not in self.native_unconfirmed:
                continue
            if compiled and self.native_runner is not None:
                times = time_native_steps(forward, cache, self.native_runner, (shape,))
                if not times:
                    continue  # no room to time it now: the next start times it again
                self.native_decisions.update(native_pays(times))
                self.loaded_detail.append(native_detail(times))
            self.native_unconfirmed.discard(key)
        if not self.native_unconfirmed:
            self.values["native_steps"] = dict(self.native_decisions)
        self._install_native(forward)

    def _defer(self, forward: PagedLlama, known: dict[str, bool]) -> None:
        """Decisions are cached: serve eager at once and leave the graphs to `load_pending`,
        those decided compiled and those not decided yet (a start-up budget left them out)."""
        self.values["compiled_steps"] = dict(known)
        self.pending = [shape for shape in SHAPES if known.get(shape_key(shape), True)]
        if self.pending:
            self.runner = self.runner or CompiledLayers(forward)
            self.runner.shapes = set()
            forward.layer_runner = self.runner
        decided = [shape_name(shape) for shape in self.pending if shape_key(shape) in known]
        untried = len(self.pending) - len(decided)
        detail = "graphs load after start-up" + (f", {untried} more tried then" if untried else "")
        detail = detail if self.pending else ""
        self.note("compiled_steps", ", ".join(decided) or "none", "cached", detail)

    def load_pending(self, cache: PagedKVCache) -> bool:
        """Load the next pending graph, timing it first where it was not decided yet (then the
        decision is saved); call it on the thread that runs the model, between calls. True
        while more remain. A graph that fails to build leaves its steps eager."""
        if not self.pending or self.runner is None:
            return False
        shape, decisions = self.pending[0], self.values["compiled_steps"]
        key = shape_key(shape)
        times = load_graphs(self.runner, cache, [shape], timed=key not in decisions)
        if times is None:
            return True  # no room in the pool now: try again later
        self.pending.pop(0)
        settled = self.values.get("native_steps")
        if shape not in self.runner.shapes:  # the compiler failed (logged): the rest would too
            self._confirm_native(self.runner.model, cache, [shape, *self.pending], compiled=False)
            self.pending.clear()
        elif key in times:
            eager, compiled = times[key]
            decisions[key] = compiled_pays(eager, compiled)
            if not decisions[key]:
                self.runner.shapes.discard(shape)
            self.loaded_detail.append(times_detail(key, eager, compiled, self.runner.model))
        if shape in self.runner.shapes or key in self.native_unconfirmed:
            self._confirm_native(self.runner.model, cache, [shape], compiled=shape in self.runner.shapes)
        if (key in times or self.values.get("native_steps") != settled) and self.store is not None \
                and self.key is not None:
            self.store.save(self.key, self.values)
        self._publish(self.runner.model)
        return bool(self.pending)

    def compiled_steps(self, forward: PagedLlama) -> tuple[str, ...]:
        """The steps `forward` serves compiled, by name: as `layer_path` and `load_pending` left
        them (read by Info while the worker may be timing a graph on the side)."""
        if self._steps is None:
            self._publish(forward)
        return self._steps or ()

    def _publish(self, forward: PagedLlama) -> None:
        self._steps = compiled_step_names(forward)

    def forward_costs(
        self, forward: PagedLlama, cache: PagedKVCache, *, max_batch: int, max_tokens: int, enabled: bool
    ) -> tuple[ForwardCost, ...]:
        """The forward cost table the gateway plans with: cached only when every other choice
        was too (a newly measured choice may have changed what a forward costs), and while this
        machine's 1-token step is not `STALE_TABLE_FACTOR` times faster than the table says
        (then it was timed while something else ran, and would misprice every round)."""
        if not enabled:
            self.note("forward_costs", "not measured", "flag", "--no-measure-costs")
            return ()
        if self.measured:
            self._cached.pop("forward_costs", None)
        stale = ""

        def measure() -> tuple[list[list[float]], str]:
            costs = measure_forward_costs(forward, cache, max_batch=max_batch, max_tokens=max_tokens)
            self.values["forward_costs_steps"] = list(compiled_step_names(forward))
            return _rows(costs), stale

        def current(value: JSON) -> bool:
            nonlocal stale
            if not isinstance(value, list) or not all(isinstance(row, list) and len(row) == 4 for row in value):
                return False
            cached_step, now = one_token_step(_table(value)), step_seconds(forward, cache)
            if cached_step is None or now is None or now * STALE_TABLE_FACTOR >= cached_step:
                self.values["forward_costs_steps"] = list(self._cached.get("forward_costs_steps") or ())
                return True
            stale = f"the cached table's 1-token step {cached_step * 1e3:.1f} ms, {now * 1e3:.1f} ms now"
            return False

        rows, reason, detail = self.decide("forward_costs", measure, current)
        costs = _table(rows)
        step = one_token_step(costs)
        self.note("forward_costs", f"{len(costs)} points", reason,
                  "; ".join(filter(None, [f"1-token step {step * 1e3:.1f} ms" if step else "", detail])))
        return costs

    @property
    def costs_steps(self) -> tuple[str, ...]:
        """The compiled steps the forward cost table was timed with (`costs_outdated`)."""
        return tuple(self.values.get("forward_costs_steps") or ())

    def costs_outdated(self, forward: PagedLlama) -> bool:
        """Whether the forward cost table was timed with other compiled steps than `forward`
        serves now: its deferred graphs loaded since (a table timed eager prices a compiled
        draft several times too dear)."""
        return "forward_costs" in self.values and self.costs_steps != compiled_step_names(forward)

    def remeasure_costs(
        self, forward: PagedLlama, cache: PagedKVCache, *, max_batch: int, max_tokens: int
    ) -> Generator[None, None, tuple[ForwardCost, ...]]:
        """The table timed again, one forward per step (`forward_cost_steps`), and kept for the
        next start with the steps it was timed with."""
        costs = yield from forward_cost_steps(forward, cache, max_batch=max_batch, max_tokens=max_tokens)
        if costs:
            self.values["forward_costs"] = _rows(costs)
            self.values["forward_costs_steps"] = list(compiled_step_names(forward))
            if self.store is not None and self.key is not None:
                self.store.save(self.key, self.values)
        return tuple(costs)


def _rows(costs: Sequence[ForwardCost]) -> list[list[float]]:
    """A cost table as the tuning cache stores it."""
    return [[c.batch_size, c.tokens, c.seconds, c.context] for c in costs]


def _table(rows: JSON) -> tuple[ForwardCost, ...]:
    return tuple(ForwardCost(int(b), int(t), float(s), context=int(n)) for b, t, s, n in rows)
