"""Whether a model's 1-token steps run natively (`specdec.model.native_steps`): each kind of
step (one request's, a batch's) timed on its own against the layer runner, as
`specdec.tuning.compiled_layers` times compiled graphs; the native call must be `MIN_GAIN`
faster to be kept.

At start-up the layer runner is eager where the compiled graphs load after start-up
(`StartupTuner.layer_path` defers them from the tuning cache): a kind kept against eager is
timed again against its compiled step once that graph has loaded (`StartupTuner.load_pending`),
and only then is the decision kept for the next start.
"""

from __future__ import annotations

from specdec.kv_cache.paged_cache import PagedKVCache
from specdec.model.llama import PagedLlama
from specdec.model.native_steps import STEP_KINDS, NativeSteps
from specdec.tuning.compiled_layers import BATCH_SLOTS, compiled_pays, has_room, step_slots
from specdec.tuning.timing import interleaved_times

#: Interleaved timed steps per path and kind.
TIMING_REPEATS = 9


def time_native_steps(
    forward: PagedLlama, cache: PagedKVCache, runner: NativeSteps, kinds: tuple[str, ...] = STEP_KINDS
) -> dict[str, tuple[float, float]]:
    """Median seconds of each of `kinds`' 1-token step, through the model's layer runner and
    natively; empty where `cache` has no room for the timing slots. Leaves
    `forward.step_runner` unset."""
    if not has_room(cache):
        return {}
    forward.step_runner = None
    with step_slots(forward, cache) as step:
        def setup(key: tuple[str, str]) -> None:
            forward.step_runner = runner if key[0] == "native" else None

        candidates = {
            (path, kind): (lambda kind=kind: step(1 if kind == "single" else BATCH_SLOTS, 1))
            for path in ("layers", "native") for kind in kinds
        }
        times = interleaved_times(candidates, repeats=TIMING_REPEATS, setup=setup)
    forward.step_runner = None
    return {kind: (times[("layers", kind)], times[("native", kind)]) for kind in kinds}


def native_pays(times: dict[str, tuple[float, float]]) -> list[str]:
    """The kinds whose native step is at least `MIN_GAIN` faster."""
    return [kind for kind, (layers, native) in times.items() if compiled_pays(layers, native)]
