"""The compiled decoder layers (`--compile`): same numbers as eager, one graph for every
context length, eager whenever compiling is off, fails or does not apply, and decisions
reused from the tuning cache.

Compiles for real (inductor, C++), once per module: a tiny int4 Llama in bfloat16, the
default draft's formats, so the int4 kernel runs inside the compiled graph. Its four
layers run as two calls of one compiled 2-layer group, with one graph for a single
request's 1-token steps, one for its 2-token steps, one each for a batch's 1- and 2-token
steps, and one each for a single request's and a batch's forwards of 3 to 17 tokens a request.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from specdec.kv_cache.paged_cache import PagedKVCache
from specdec.model.cuda_graphs import StepGraphs
from specdec.model.forward_batch import ForwardBatch
from specdec.model.llama import PagedLlama
from specdec.model.quantize import quantize_int8
from specdec.model.quantize_int4 import quantize_int4
from specdec.model.step_shapes import MAX_MULTI, MULTI, SHAPES, shape_key
from specdec.tuning import compiled_layers
from specdec.tuning.compiled_layers import (
    TIMING_CONTEXT,
    CompiledLayers,
    choose_layer_path,
    compile_options,
    compiled_step_names,
    layers_per_compiled_call,
)
from specdec.tuning.startup import StartupTuner
from specdec.tuning.store import TuningKey, TuningStore
from tests.support.tiny_models import tiny_llama

PROMPT = [(i * 37) % 256 for i in range(200)]


def _int4_forward() -> PagedLlama:
    model = tiny_llama(num_layers=4)
    quantize_int4(model, group_size=32, include_lm_head=False)
    quantize_int8(model)
    return PagedLlama(model.to(torch.bfloat16))


def _runner(forward: PagedLlama) -> CompiledLayers:
    return CompiledLayers(forward, layers_per_call=2)


def _use(runner: CompiledLayers, path: str) -> PagedLlama:
    """Run `runner`'s model on `path`, the compiled one for every shape class; returns the model."""
    forward = runner.model
    runner.shapes = set(SHAPES)
    forward.layer_runner = runner if path == "compiled" else forward.eager_layers
    return forward


@pytest.mark.parametrize(("num_layers", "per_call"), [(30, 10), (16, 8), (28, 7), (2, 2), (1, 1), (31, 1)])
def test_layers_are_compiled_in_equal_groups_of_at_most_ten(num_layers: int, per_call: int) -> None:
    assert layers_per_compiled_call(num_layers) == per_call


@pytest.fixture(scope="module")
def runner() -> CompiledLayers:
    forward = _int4_forward()
    cache = forward.new_cache(token_budget=1024)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # No budget: every shape is built however long this machine takes to compile it.
    chosen = choose_layer_path(forward, cache, "on", budget_s=math.inf, runner=_runner(forward))
    assert chosen.path == "compiled" and chosen.runner is forward.layer_runner and not chosen.measured
    # One graph per shape class: the batch graph is dynamic in the batch size from its first
    # warm-up step (a recompile for the second would cost as much start-up again).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == len(SHAPES)
    assert cache.blocks.free_tokens == cache.capacity_tokens  # its timing slots are gone
    return chosen.runner


@contextlib.contextmanager
def compiled_graph_only(runner: CompiledLayers) -> Iterator[None]:
    """Fail unless the calls inside ran the warm-up's compiled graph: a call that would need
    another graph (which serving would quietly run eager) compiles one here and is caught."""
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    runner.compile_on_miss = True
    try:
        with torch.profiler.profile() as profile:
            yield
    finally:
        runner.compile_on_miss = False
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert any(event.name.startswith("Torch-Compiled Region") for event in profile.events())


def _decode(runner: CompiledLayers, path: str, prompt_len: int, steps: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Logits of `steps` greedy 1-token steps after an eager prefill, and the slot's cached K/V."""
    forward = _use(runner, path)
    cache = forward.new_cache(token_budget=512)
    cache.blocks.allocate("s")
    (logits,) = forward.run(cache, [("s", PROMPT[:prompt_len])])
    out = []
    with compiled_graph_only(runner) if path == "compiled" else contextlib.nullcontext():
        for _ in range(steps):
            (logits,) = forward.run(cache, [("s", [int(logits.argmax())])])
            out.append(logits.float())
    rows = torch.tensor(cache.blocks.positions("s"))
    return out, torch.stack([kv.index_select(0, rows).float() for kv in cache.kv])  # [layers, len, 2, Hkv, D]


Chunks = list[tuple[str, list[int]]]


def _steps_on_both_paths(
    runner: CompiledLayers, lengths: dict[str, int], steps: list[Chunks], logits: str = "last"
) -> dict[str, tuple[list[torch.Tensor], PagedKVCache]]:
    """Prefill each slot of `lengths` with that many PROMPT tokens, then run `steps` (each
    one batched call), eager and then compiled; the compiled steps must run warm-up graphs.
    Returns each path's logits, in call order, and its cache."""
    runs = {}
    for path in ("eager", "compiled"):
        forward = _use(runner, path)
        cache = forward.new_cache(token_budget=1024)
        for slot, length in lengths.items():
            cache.blocks.allocate(slot)
            forward.run(cache, [(slot, PROMPT[:length])])
        results: list[torch.Tensor] = []
        with compiled_graph_only(runner) if path == "compiled" else contextlib.nullcontext():
            for chunks in steps:
                results += forward.run(cache, chunks, logits=logits)
        runs[path] = (results, cache)
    return runs


def _assert_same_logits(runs: dict[str, tuple[list[torch.Tensor], PagedKVCache]]) -> None:
    # bf16 activations: the compiled kernels round once where eager rounds after every op.
    for want, got in zip(runs["eager"][0], runs["compiled"][0], strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("prompt_len", [3, 61, 190])
def test_compiled_steps_match_eager_at_every_context_length(runner: CompiledLayers, prompt_len: int) -> None:
    eager_logits, eager_kv = _decode(runner, "eager", prompt_len, steps=6)
    compiled_logits, compiled_kv = _decode(runner, "compiled", prompt_len, steps=6)
    for want, got in zip(eager_logits, compiled_logits):
        # bf16 activations: the compiled kernels round once where eager rounds after every op.
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
    torch.testing.assert_close(compiled_kv, eager_kv, atol=0.02, rtol=0.02)  # the cache writes landed in the same rows


def test_one_graph_serves_every_context_length(runner: CompiledLayers) -> None:
    forward = _use(runner, "compiled")
    cache = forward.new_cache(token_budget=512)
    cache.blocks.allocate("s")
    forward.run(cache, [("s", PROMPT[:5])])
    with compiled_graph_only(runner):
        for token in PROMPT[5:40]:
            forward.run(cache, [("s", [token])])


def test_two_token_steps_run_their_own_graph_with_the_same_numbers(runner: CompiledLayers) -> None:
    # The step that opens a drafting round after a fully accepted one feeds two tokens.
    steps = [[("s", PROMPT[start : start + 2])] for start in range(40, 52, 2)]
    _assert_same_logits(_steps_on_both_paths(runner, {"s": 40}, steps, logits="all"))


def test_further_shapes_wait_for_a_quick_first_graph(runner: CompiledLayers) -> None:
    forward = runner.model
    # A negative budget: the first graph always took too long.
    chosen = choose_layer_path(forward, forward.new_cache(token_budget=1024), "on", budget_s=-1.0, runner=runner)
    assert chosen.path == "compiled" and runner.shapes == {(1, 1)}
    assert compiled_step_names(forward) == ("single-request 1-token steps",)  # what Info reports
    assert chosen.decisions == {"1x1": True}  # the others are left for a later start
    chosen = choose_layer_path(forward, forward.new_cache(token_budget=1024), "on", budget_s=math.inf, runner=runner)
    assert runner.shapes == set(SHAPES)
    assert compiled_step_names(forward) == (
        "single-request 1-token steps", "single-request 2-token steps", "single-request 3-17-token steps",
        "batch 1-token steps", "batch 2-token steps", "batch 3-17-token steps",
    )


def test_single_request_forwards_of_3_to_17_tokens_run_one_graph_with_the_same_numbers(
    runner: CompiledLayers,
) -> None:
    """A verify, or a drawn token fed with guessed ones: any width from MULTI to MAX_MULTI runs
    the one graph (the width dynamic), with eager's logits for every row and its cache writes."""
    widths = (MULTI, 9, MAX_MULTI, 5)
    starts = [40 + sum(widths[:i]) for i in range(len(widths))]
    steps = [[("s", PROMPT[start : start + width])] for start, width in zip(starts, widths)]
    runs = _steps_on_both_paths(runner, {"s": 40}, steps, logits="all")
    _assert_same_logits(runs)
    rows = torch.tensor(runs["eager"][1].blocks.positions("s"))
    for eager_kv, compiled_kv in zip(runs["eager"][1].kv, runs["compiled"][1].kv):
        torch.testing.assert_close(compiled_kv.index_select(0, rows).float(), eager_kv.index_select(0, rows).float(),
                                   atol=0.02, rtol=0.02)


def test_batch_steps_of_any_size_run_one_graph_with_the_same_numbers(runner: CompiledLayers) -> None:
    """2, 3 and 5 requests at different context lengths, 1 token each: the batch graph (the
    batch size dynamic), with eager's logits and cache writes."""
    lengths = {"a": 20, "b": 33, "c": 7, "d": 61, "e": 45}
    batches = (["a", "b"], ["c", "d", "e"], ["a", "b", "c", "d", "e"], ["e", "a"])
    steps = [[(slot, [PROMPT[100 + len(slot)]]) for slot in batch] for batch in batches]
    runs = _steps_on_both_paths(runner, lengths, steps)
    _assert_same_logits(runs)
    eager_cache, compiled_cache = runs["eager"][1], runs["compiled"][1]
    for slot in lengths:
        rows = torch.tensor(eager_cache.blocks.positions(slot))
        for eager_kv, compiled_kv in zip(eager_cache.kv, compiled_cache.kv):
            torch.testing.assert_close(compiled_kv.index_select(0, rows).float(),
                                       eager_kv.index_select(0, rows).float(), atol=0.02, rtol=0.02)


def test_batch_forwards_of_3_to_17_tokens_run_one_graph_with_the_same_numbers(runner: CompiledLayers) -> None:
    """A batch's verify or guessed forwards: rows of 1 to 17 tokens padded to the widest (3 to
    17), at 2 and 3 requests, run the one batch graph (batch size and width dynamic) with
    eager's logits."""
    steps: list[Chunks] = [  # each step reads what the steps before wrote
        [("a", PROMPT[160:169]), ("b", PROMPT[169:172])],
        [("a", PROMPT[172:173]), ("b", PROMPT[173:190]), ("c", PROMPT[190:195])],
        [("c", PROMPT[100:104]), ("a", PROMPT[104:108])],
    ]
    _assert_same_logits(_steps_on_both_paths(runner, {"a": 20, "b": 33, "c": 7}, steps, logits="all"))


def test_batch_round_openings_run_their_own_graph_with_the_same_numbers(runner: CompiledLayers) -> None:
    """A batch's round-opening feed: rows after a fully accepted round feed 2 tokens, the
    others 1, padded to one [B, 2] step that runs the batch 2-token graph with eager's numbers."""
    steps: list[Chunks] = [  # the second step reads what the first wrote
        [("a", PROMPT[150:152]), ("b", [PROMPT[152]])],
        [("a", [PROMPT[153]]), ("b", PROMPT[154:156]), ("c", PROMPT[156:158])],
    ]
    _assert_same_logits(_steps_on_both_paths(runner, {"a": 20, "b": 33, "c": 7}, steps, logits="all"))


def test_wider_chunks_run_eager_with_the_same_numbers(runner: CompiledLayers) -> None:
    results = {}
    for path in ("eager", "compiled"):
        forward = _use(runner, path)
        cache = forward.new_cache(token_budget=512)
        for slot, length in (("a", 20), ("b", 33)):
            cache.blocks.allocate(slot)
            forward.run(cache, [(slot, PROMPT[:length])])
        results[path] = forward.run(cache, [("a", [1]), ("b", PROMPT[:MAX_MULTI + 1])], logits="all")
        results[path] += forward.run(cache, [("a", PROMPT[:MAX_MULTI + 1])], logits="all")  # past the 3-17 graphs
    for want, got in zip(results["eager"], results["compiled"]):
        assert torch.equal(want, got)  # the same eager code ran both times


def test_serving_checks_only_the_guards_that_tell_graphs_apart(
    runner: CompiledLayers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Warmed up, steps skip dynamo's full guard check and keep the warm-up graphs' numbers;
    a 1-token prompt, which attends only to its own key (no graph holds that path), runs eager."""
    stances: list[bool] = []
    set_stance = torch.compiler.set_stance

    def recording_stance(stance: str = "default", **kwargs: bool) -> object:
        stances.append(bool(kwargs.get("skip_guard_eval_unsafe")))
        return set_stance(stance, **kwargs)

    steps = [[("a", [7])], [("a", [8])], [("a", [9, 10])], [("a", [11]), ("b", [12])],
             [("a", [13]), ("b", [14]), ("c", [15])]]
    results: dict[str, list[torch.Tensor]] = {}
    for path in ("eager", "compiled"):
        forward = _use(runner, path)
        cache = forward.new_cache(token_budget=512)
        results[path] = []
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        with monkeypatch.context() as patch:
            patch.setattr(torch.compiler, "set_stance", recording_stance)
            for chunks in steps:  # "a" starts from one token, "b" and "c" join a batch with one token each
                for slot, _ in chunks:
                    if not cache.blocks.has_slot(slot):
                        cache.blocks.allocate(slot)
                with torch.profiler.profile() as profile:
                    results[path] += forward.run(cache, chunks)
                ran_compiled = any(event.name.startswith("Torch-Compiled Region") for event in profile.events())
                assert ran_compiled == (path == "compiled" and chunks != steps[0])  # the 1-token prompt ran eager
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # nothing compiled while serving
    # Two calls a step (two 2-layer groups) after the prompt, each making only the short check.
    assert len(stances) == 2 * (len(steps) - 1) and all(stances)
    assert torch.equal(results["compiled"][0], results["eager"][0])  # the prompt ran the eager code
    for want, got in zip(results["eager"], results["compiled"]):
        torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.02)


def test_off_does_not_compile(runner: CompiledLayers) -> None:
    fresh = _int4_forward()
    chosen = choose_layer_path(fresh, fresh.new_cache(token_budget=1024), "off")
    assert chosen.runner is None and chosen.path == "eager" and chosen.decisions == {}
    assert fresh.layer_runner == fresh.eager_layers and compiled_step_names(fresh) == ()


def test_auto_keeps_the_shapes_measured_faster(runner: CompiledLayers, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decision follows the timing (pinned here: compiled faster for 1-token steps only)."""
    def pinned(candidates: dict[tuple[str, tuple[int, int]], object], **kwargs: object) -> dict[object, float]:
        return {(path, shape): 1.0 if path == "compiled" and shape[1] == 1 else 2.0 for path, shape in candidates}

    monkeypatch.setattr(compiled_layers, "interleaved_times", pinned)
    forward = runner.model
    chosen = choose_layer_path(forward, forward.new_cache(token_budget=1024), "auto", budget_s=math.inf, runner=runner)
    assert chosen.measured and chosen.path == "compiled" and runner.shapes == {(1, 1), (2, 1)}
    assert chosen.decisions == {"1x1": True, "1x2": False, "2x1": True, "2x2": False, "1x3": False, "2x3": False}
    assert forward.layer_runner is runner and set(chosen.times) == {shape_key(s) for s in SHAPES}


def test_compiled_steps_are_timed_against_the_step_graphs_where_installed(
    runner: CompiledLayers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA an uncompiled step replays its CUDA graph, so that is what "auto" times a compiled
    step against (here `StepGraphs` without capture: the same padded path, eagerly)."""
    forward = runner.model
    cache = forward.new_cache(token_budget=1024)
    graphs = StepGraphs(forward, cache, max_requests=4, max_tokens=17, max_blocks=64, capture=True)
    replays = 0
    run = graphs.run

    def counting(batch: ForwardBatch) -> torch.Tensor:
        nonlocal replays
        replays += 1
        return run(batch)

    def replays_per_call(candidates: dict[object, Callable[[], object]], *, setup: Callable[[object], None],
                         **kwargs: object) -> dict[object, float]:
        """Each candidate called once: its "seconds" are the replays it made."""
        counts = {}
        for key, call in candidates.items():
            setup(key)
            before = replays
            call()
            counts[key] = float(replays - before)
        return counts

    monkeypatch.setattr(graphs, "run", counting)
    monkeypatch.setattr(compiled_layers, "interleaved_times", replays_per_call)
    forward.step_graphs = graphs
    try:
        chosen = choose_layer_path(forward, cache, "auto", budget_s=math.inf, runner=runner)
        detail = compiled_layers.times_detail("1x1", 2e-3, 1e-3, forward)
    finally:
        forward.step_graphs = None
    assert chosen.times == {shape_key(shape): (1.0, 0.0) for shape in SHAPES}  # every eager step replayed
    assert detail == "1x1 graphs / compiled 2.0 / 1.0 ms"


def test_auto_reuses_known_decisions_without_timing(runner: CompiledLayers, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_timing(*args: object, **kwargs: object) -> None:
        raise AssertionError("timed although every decision was known")

    monkeypatch.setattr(compiled_layers, "interleaved_times", no_timing)
    forward = runner.model
    known = {"1x1": True, "1x2": False, "2x1": False, "2x2": True, "1x3": False, "2x3": False}
    chosen = choose_layer_path(forward, forward.new_cache(token_budget=1024), "auto", known=known, runner=runner)
    assert not chosen.measured and runner.shapes == {(1, 1), (2, 2)} and chosen.decisions == known
    everything_eager = dict.fromkeys(known, False)
    chosen = choose_layer_path(forward, forward.new_cache(token_budget=1024), "auto", known=everything_eager,
                               runner=runner)
    assert chosen.path == "eager" and forward.layer_runner == forward.eager_layers
    assert chosen.decisions == everything_eager


def test_a_small_pool_or_a_failing_compiler_leaves_the_model_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    forward = _int4_forward()
    assert choose_layer_path(forward, forward.new_cache(token_budget=TIMING_CONTEXT), "on").path == "eager"

    def broken_compile(fn: object, **kwargs: object) -> object:
        def raises(*args: object) -> None:
            raise RuntimeError("no C++ compiler here")
        return raises

    monkeypatch.setattr(torch, "compile", broken_compile)
    cache = forward.new_cache(token_budget=1024)
    assert choose_layer_path(forward, cache, "on").path == "eager"
    assert forward.layer_runner == forward.eager_layers and cache.blocks.free_tokens == cache.capacity_tokens
    cache.blocks.allocate("s")
    (logits,) = forward.run(cache, [("s", PROMPT[:4])])
    assert logits.shape == (256,)
    forward.run(cache, [("s", [int(logits.argmax())])])  # a 1-token step still runs (eager)


def test_cached_decisions_leave_the_graphs_for_after_start_up(runner: CompiledLayers, tmp_path: Path) -> None:
    """A restart with every decision cached serves eager at once; the graphs it decided on load
    afterwards, one call at a time, without timing anything."""
    key = TuningKey(machine="m", torch="t", model="tiny", weights="w", dtype="bfloat16", quantization="int4",
                    device="cpu", threads=1, code="c", settings="")
    known = {"1x1": True, "1x2": False, "2x1": True, "2x2": False, "1x3": False, "2x3": False}
    TuningStore(tmp_path).save(key, {"compiled_steps": known})
    forward = runner.model
    cache = forward.new_cache(token_budget=1024)
    tuner = StartupTuner(TuningStore(tmp_path), key)
    tuner.runner = runner
    tuner.layer_path(forward, cache, "auto", math.inf, measure=True)
    assert tuner.pending == [(1, 1), (2, 1)] and forward.layer_runner is runner and runner.shapes == set()
    assert (tuner.choices[-1].reason, tuner.choices[-1].detail) == ("cached", "graphs load after start-up")
    assert not tuner.measured and tuner.values["compiled_steps"] == known
    loads = 0
    while tuner.load_pending(cache):
        loads += 1
    assert loads == 1 and runner.shapes == {(1, 1), (2, 1)} and tuner.pending == []
    assert tuner.compiled_steps(forward) == ("single-request 1-token steps", "batch 1-token steps")
    assert cache.blocks.free_tokens == cache.capacity_tokens


def test_undecided_shapes_are_timed_after_start_up_and_their_decisions_saved(
    runner: CompiledLayers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart after a start whose budget left shapes out serves at once too: the decided
    graphs load, the others are built and timed (pinned here) afterwards, and the cache learns."""
    key = TuningKey(machine="m", torch="t", model="tiny", weights="w", dtype="bfloat16", quantization="int4",
                    device="cpu", threads=1, code="c", settings="")
    TuningStore(tmp_path).save(key, {"compiled_steps": {"1x1": True}})

    def pinned(candidates: dict[tuple[str, tuple[int, int]], object], **kwargs: object) -> dict[object, float]:
        return {(path, shape): 1.0 if path == "compiled" and shape == (2, 1) else 2.0 for path, shape in candidates}

    monkeypatch.setattr(compiled_layers, "interleaved_times", pinned)
    forward = runner.model
    cache = forward.new_cache(token_budget=1024)
    tuner = StartupTuner(TuningStore(tmp_path), key)
    tuner.runner = runner
    tuner.layer_path(forward, cache, "auto", math.inf, measure=True)
    assert tuner.pending == list(SHAPES) and runner.shapes == set()
    assert tuner.choices[-1].value == "single-request 1-token steps"
    assert tuner.choices[-1].detail == "graphs load after start-up, 5 more tried then"
    while tuner.load_pending(cache):
        pass
    assert runner.shapes == {(1, 1), (2, 1)} and len(tuner.loaded_detail) == 5
    assert TuningStore(tmp_path).load(key)["compiled_steps"] == {
        "1x1": True, "1x2": False, "2x1": True, "2x2": False, "1x3": False, "2x3": False,
    }


def test_the_cpp_wrapper_is_asked_for_on_the_cpu_only() -> None:
    """On CUDA it would build against the CUDA headers at run time, which a slim image lacks."""
    cpu, cuda = compile_options(torch.device("cpu")), compile_options(torch.device("cuda", 0))
    assert cpu["cpp_wrapper"] is True and cuda["cpp_wrapper"] is False
    assert cpu["guard_filter_fn"] is cuda["guard_filter_fn"] is torch.compiler.skip_guard_on_all_nn_modules_unsafe
