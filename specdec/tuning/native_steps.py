"""Which shape classes of decoding forwards run natively (`specdec.model.native_steps`): each
class timed on its own against the layer runner, as `specdec.tuning.compiled_layers` times
compiled graphs; the native call must be `MIN_GAIN` faster to be kept.

At start-up the layer runner is eager where the compiled graphs load after start-up
(`StartupTuner.layer_path` defers them from the tuning cache): a class kept against eager is
timed again against its compiled graph once that has loaded (`StartupTuner.load_pending`), and
only then is the decision kept for the next start.
"""

from __future__ import annotations

from collections.abc import Mapping

from specdec.kv_cache.paged_cache import PagedKVCache
from specdec.model.llama import PagedLlama
from specdec.model.native_steps import NATIVE_SHAPES, NativeSteps
from specdec.model.step_shapes import Shape, shape_key
from specdec.tuning.compiled_layers import compiled_pays, has_room, step_slots, timing_step
from specdec.tuning.timing import interleaved_times

#: Interleaved timed forwards per path and shape class.
TIMING_REPEATS = 9


def time_native_steps(
    forward: PagedLlama, cache: PagedKVCache, runner: NativeSteps, shapes: tuple[Shape, ...] = NATIVE_SHAPES
) -> dict[str, tuple[float, float]]:
    """Median seconds of a forward of each of `shapes` (`shape_key`), through the model's layer
    runner and natively; empty where `cache` has no room for the timing slots. Leaves
    `forward.step_runner` unset."""
    if not has_room(cache):
        return {}
    forward.step_runner = None
    with step_slots(forward, cache) as step:
        def setup(key: tuple[str, Shape]) -> None:
            forward.step_runner = runner if key[0] == "native" else None

        candidates = {(path, shape): timing_step(step, shape) for path in ("layers", "native") for shape in shapes}
        times = interleaved_times(candidates, repeats=TIMING_REPEATS, setup=setup)
    forward.step_runner = None
    return {shape_key(shape): (times[("layers", shape)], times[("native", shape)]) for shape in shapes}


def native_pays(times: Mapping[str, tuple[float, float]]) -> dict[str, bool]:
    """Per shape class (`shape_key`): whether its native forward is at least `MIN_GAIN` faster."""
    return {key: compiled_pays(layers, native) for key, (layers, native) in times.items()}


def native_detail(times: Mapping[str, tuple[float, float]]) -> str:
    """The timings, for the start-up line."""
    return ", ".join(f"{key} layers / native {a * 1e3:.2f} / {b * 1e3:.2f} ms" for key, (a, b) in times.items())
