"""Tests for the native decoding forward (`specdec.model.native_steps`, `csrc/decode_layers.cpp`
and `decode_attention.cpp`): logits and keys and values as close to an fp32 forward of the same
int4 weights as the eager layers' are, for steps, round openings and guessed forwards, one
request or a batch, over contexts that cross block boundaries or are cut into pieces between
threads, with either attention kernel; the real draft's steps; which forwards it takes and what
it refuses; and the start-up choice per shape class (`StartupTuner.native_steps`). The AVX2
build is checked too, in a process that asks for it (`SPECDEC_INT4DOT_ISA`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from specdec.model import int4_dot
from specdec.model.attention import make_attention
from specdec.model.choices import DEFAULT_MODEL, AttentionKernel
from specdec.model.llama import PagedLlama
from specdec.model.native_steps import NATIVE_SHAPES, NativeSteps, unsupported
from specdec.model.quantize_int4 import quantize_int4
from specdec.model.runtime import build_runtime
from specdec.model.step_shapes import MANY, MULTI, Shape, shape_key
from specdec.tuning import startup
from specdec.tuning.compiled_layers import CompiledLayers
from specdec.tuning.native_steps import native_pays
from specdec.tuning.startup import StartupTuner
from specdec.tuning.store import TuningKey, TuningStore
from tests.support.models import SUITE_LAYERS
from tests.support.tiny_models import tiny_llama

needs_kernel = pytest.mark.skipif(not int4_dot.available(),
                                  reason="int4dot needs AVX-512 BF16 or AVX2, and a C++ compiler")
TUNING_KEY = TuningKey(machine="m", torch="t", model="tiny", weights="w", dtype="bfloat16", quantization="int4",
                       device="cpu", threads=2, code="c", settings="")
#: Contexts before the step: inside the first block, at its end, across several.
CONTEXTS = (1, 15, 16, 37)


def int4_llama(num_layers: int = 3, *, reference: bool = False, sharpness: float = 1.0,
               head_dim: int = 32, query_heads: int = 4) -> PagedLlama:
    """A random Llama in bf16 with int4 projections on the int4dot kernel: `query_heads` query
    heads and 2 KV heads of `head_dim`, MLP 256 wide (every width a multiple of 64, as int4dot
    needs). The `reference`: the same int4 weights with fp32 activations, on the dequantizing
    kernel. `sharpness` scales the query and key projections: random weights attend almost
    evenly, and scores `sharpness`² times as large pick out a few positions."""
    config = tiny_llama(num_layers).config
    config.hidden_size, config.intermediate_size, config.head_dim = 128, 256, head_dim
    config.num_attention_heads = query_heads
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(sharpness)
            layer.self_attn.k_proj.weight.mul_(sharpness)
    quantize_int4(model, include_lm_head=False, kernel="dequant" if reference else "int4dot")
    return PagedLlama(model.float() if reference else model)


def forward_logits(
    model: PagedLlama, chunks: tuple[tuple[int, int], ...], native: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of every new token of one decoding forward, a (context, new tokens) chunk a
    request, and the keys and values it wrote in the first layer. # [n, vocab], [n, 2, Hkv, D]"""
    cache = model.new_cache(token_budget=512, block_size=16)
    vocab = model.vocab_size
    slots = [f"s{i}" for i in range(len(chunks))]
    prompts = [[(7 * i + 3 * n) % vocab for n in range(context + new)] for i, (context, new) in enumerate(chunks)]
    for slot in slots:
        cache.blocks.allocate(slot)
    model.step_runner = None
    model.run(cache, [(slot, prompt[:context]) for slot, prompt, (context, _) in zip(slots, prompts, chunks)])
    model.step_runner = NativeSteps(model) if native else None
    new_tokens = [(slot, prompt[context:]) for slot, prompt, (context, _) in zip(slots, prompts, chunks)]
    logits = torch.cat(model.run(cache, new_tokens, logits="all", prompt=False))
    rows = [cache.blocks.block_table(slot)[position // 16] * 16 + position % 16
            for slot, prompt, (context, _) in zip(slots, prompts, chunks) for position in range(context, len(prompt))]
    model.step_runner = None
    return logits.float(), cache.kv[0][rows].float()


#: Decoding forwards, a (context, new tokens) chunk a request: 1-token steps inside a block, at
#: its end and across several; a round's 2-token opening; a guessed forward; batches of them,
#: one with a chunk shorter than the other (a padding row that writes nothing); the widest feed.
FORWARDS = (((1, 1),), ((37, 1),), tuple((context, 1) for context in CONTEXTS), ((20, 2),), ((5, 5),),
            ((15, 2), (37, 1)), ((3, 4), (20, 4)), ((20, 17),))
#: Long enough for attention to cut each context into pieces where its units do not divide
#: evenly over the threads (`context_chunks` in csrc/decode_attention.cpp: 64 positions a piece).
LONG_FORWARDS = (((200, 1),), ((150, 2), (300, 1)))
#: Query and key scale of the model those forwards run (`int4_llama`).
SHARPNESS = 4.0


def check_parity(model: PagedLlama, reference: PagedLlama,
                 forwards: tuple[tuple[tuple[int, int], ...], ...] = FORWARDS) -> None:
    """The native forward is as close to `reference` (the same weights with fp32 activations)
    as the eager bf16 forward is, within a bf16 step: it keeps the residual stream and the
    elementwise math in fp32 (rounding only a matmul's input and the result), where eager rounds
    every op's output, so the two differ by about a step but a wrong mask, position or row
    would put it far off."""
    for chunks in forwards:
        want, want_kv = forward_logits(reference, chunks, native=False)
        eager, eager_kv = forward_logits(model, chunks, native=False)
        got, got_kv = forward_logits(model, chunks, native=True)
        step = 2**-8 * float(want.abs().max())
        assert float((got - want).abs().max()) <= float((eager - want).abs().max()) + step, chunks
        kv_step = 2**-8 * float(want_kv.abs().max())
        assert float((got_kv - want_kv).abs().max()) <= float((eager_kv - want_kv).abs().max()) + kv_step, chunks


@needs_kernel
@pytest.mark.parametrize("kernel", list(AttentionKernel))
def test_native_forwards_are_as_close_to_fp32_as_the_eager_layers(kernel: AttentionKernel) -> None:
    model, reference = int4_llama(), int4_llama(reference=True)
    model.attention = reference.attention = make_attention(kernel)
    assert unsupported(model) == ""
    check_parity(model, reference)


@needs_kernel
@pytest.mark.parametrize("threads", [2, 3])
def test_attention_over_a_context_cut_into_pieces_is_as_close(threads: int) -> None:
    """2 KV heads over 3 threads: a row's units do not divide evenly, so each long context is
    cut into 3 pieces whose sums are merged; over 2 threads it is not cut. Either way as close
    to fp32 as the eager layers."""
    model, reference = int4_llama(sharpness=SHARPNESS), int4_llama(reference=True, sharpness=SHARPNESS)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_parity(model, reference, LONG_FORWARDS)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_heads_of_128_values_take_a_kv_heads_queries_in_two_passes() -> None:
    """Heads of 128 values leave registers for 2 query heads a pass (`kHeadsPerPass` in
    csrc/decode_attention.cpp), so a KV head's 3 query heads take a pass of 2 and one of 1."""
    model = int4_llama(2, sharpness=SHARPNESS, head_dim=128, query_heads=6)
    reference = int4_llama(2, reference=True, sharpness=SHARPNESS, head_dim=128, query_heads=6)
    assert unsupported(model) == ""
    check_parity(model, reference, FORWARDS[:4] + LONG_FORWARDS)


@needs_kernel
def test_it_serves_only_the_classes_it_was_given_up_to_17_rows() -> None:
    """Up to a single request's widest feed: 16 accepted tokens of a lookup and the bonus token."""
    model = int4_llama(1)
    runner = NativeSteps(model, shapes=((1, 1), (MANY, 2), (1, MULTI)))
    cache = model.new_cache(token_budget=1024)
    for slot in "abcdefghi":
        cache.blocks.allocate(slot)
        # Prompts: the layer runner's. c's is long enough for its 17-token step to read its
        # context through a mask (SDPA's own layout for a chunk of over half its context).
        model.run(cache, [(slot, list(range(1, 41)) if slot == "c" else [1, 2, 3])])
    model.step_runner = runner
    calls: list[int] = []
    real = torch.ops.specdec.decode_layers

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return real(*args)

    original, torch.ops.specdec.decode_layers = torch.ops.specdec.decode_layers, counted
    try:
        model.run(cache, [("a", [4])], prompt=False)  # (1, 1)
        model.run(cache, [("a", [5]), ("b", [4, 5])], prompt=False)  # (MANY, 2)
        model.run(cache, [("c", list(range(10, 27)))], prompt=False)  # (1, MULTI), 17 rows
        assert len(calls) == 3
        model.run(cache, [("a", [6, 7])], prompt=False)  # (1, 2): not given
        model.run(cache, [("a", [8]), ("b", [6])], prompt=False)  # (MANY, 1): not given
        model.run(cache, [(slot, [9, 9]) for slot in "abcdefghi"], prompt=False)  # (MANY, 2), but 18 rows
        assert len(calls) == 3
    finally:
        torch.ops.specdec.decode_layers = original


@needs_kernel
def test_models_it_cannot_run_are_refused_with_the_reason() -> None:
    float_model = PagedLlama(tiny_llama(1))
    assert "bfloat16" in unsupported(float_model)
    with pytest.raises(ValueError, match="cannot run"):
        NativeSteps(float_model)
    dense = PagedLlama(tiny_llama(1).to(torch.bfloat16))
    assert "int4" in unsupported(dense)
    assert "heads of 160 values" in unsupported(int4_llama(1, head_dim=160))


@needs_kernel
def test_the_op_checks_its_inputs() -> None:
    model = int4_llama(1)
    runner = NativeSteps(model)
    cache = model.new_cache(token_budget=64)
    hidden = torch.zeros(1, 128, dtype=torch.float32)  # fp32, not bf16
    cos = sin = torch.zeros(1, 32, dtype=torch.bfloat16)
    index = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.specdec.decode_layers(hidden, cos, sin, index, index.view(1, 1), torch.zeros(1, 1), cache.kv,
                                        runner.table, runner.norms, 4, 2, 1e-5)
    with pytest.raises(RuntimeError, match="write_index"):
        torch.ops.specdec.decode_layers(hidden.bfloat16(), cos, sin, index + 10**6, index.view(1, 1),
                                        torch.zeros(1, 1), cache.kv, runner.table, runner.norms, 4, 2, 1e-5)
    with pytest.raises(RuntimeError, match="context_index"):  # nothing is read outside the pool
        torch.ops.specdec.decode_layers(hidden.bfloat16(), cos, sin, index, index.view(1, 1) - 1,
                                        torch.zeros(1, 1), cache.kv, runner.table, runner.norms, 4, 2, 1e-5)


def test_each_class_is_kept_where_it_is_faster_by_the_margin() -> None:
    assert native_pays({"1x1": (4.0e-3, 3.0e-3), "2x1": (6.0e-3, 5.9e-3)}) == {"1x1": True, "2x1": False}


@needs_kernel
@pytest.mark.parametrize(("mode", "installed"), [("off", False), ("on", True)])
def test_the_flag_decides_without_timing(mode: str, installed: bool) -> None:
    model = int4_llama(1)
    tuner = StartupTuner()
    tuner.native_steps(model, model.new_cache(token_budget=1024), mode, measure=True)
    assert (model.step_runner is not None) is installed
    choice = next(c for c in tuner.choices if c.name == "native_steps")
    assert choice.reason == "flag" and not tuner.measured


@needs_kernel
def test_auto_times_both_paths_and_records_the_choice() -> None:
    model = int4_llama(1)
    tuner = StartupTuner()
    tuner.native_steps(model, model.new_cache(token_budget=1024), "auto", measure=True)
    choice = next(c for c in tuner.choices if c.name == "native_steps")
    assert choice.reason == "measured" and "native" in choice.detail
    decided = tuner.values["native_steps"]
    assert isinstance(decided, dict) and set(decided) == {shape_key(shape) for shape in NATIVE_SHAPES}
    served = model.step_runner.shapes if isinstance(model.step_runner, NativeSteps) else set()
    assert {shape_key(shape) for shape in served} == {key for key, kept in decided.items() if kept}


def test_a_model_that_cannot_take_it_is_noted_not_timed() -> None:
    model = PagedLlama(tiny_llama(1))
    tuner = StartupTuner()
    tuner.native_steps(model, model.new_cache(token_budget=1024), "auto", measure=True)
    choice = next(c for c in tuner.choices if c.name == "native_steps")
    assert choice.value == "none" and choice.reason == "fixed" and model.step_runner is None


@needs_kernel
@pytest.mark.skipif(int4_dot.instruction_set() != "avx512_bf16", reason="this CPU's own build is the AVX2 one")
def test_the_avx2_build_matches_too() -> None:
    """On an AVX-512 CPU the AVX2 build is the one CPUs without AVX-512 BF16 run: asked for by name."""
    env = {**os.environ, int4_dot.ISA_ENV: "avx2"}
    script = ("from specdec.model import int4_dot\n"
              "assert int4_dot.available() and int4_dot.instruction_set() == 'avx2'\n"
              "from tests.specdec.model.test_native_steps import check_parity, int4_llama\n"
              "check_parity(int4_llama(), int4_llama(reference=True))\n")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


@needs_kernel
def test_the_real_draft_steps_as_the_eager_layers_do() -> None:
    """The suite's cut of SmolLM2 as the default draft runs it (int4 on int4dot, bf16), greedy,
    teacher-forced by the eager path: logits within a few bf16 steps (eager rounds every op,
    native only a matmul's input), the same token wherever the eager top two are further apart
    than that."""
    runtime = build_runtime(DEFAULT_MODEL, dtype="bfloat16", quantization="int4", num_layers=SUITE_LAYERS,
                            int4_kernel="int4dot")
    model = runtime.model
    assert unsupported(model) == ""
    native = NativeSteps(model)
    prompt = runtime.loaded.tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"]
    for batch in (1, 3):
        cache = model.new_cache(token_budget=1024)
        slots = [f"s{i}" for i in range(batch)]
        for i, slot in enumerate(slots):
            cache.blocks.allocate(slot)
            model.run(cache, [(slot, prompt[: len(prompt) - i])])
        tokens = [prompt[-1]] * batch
        for _ in range(8):
            model.step_runner = None
            want = torch.stack(model.run(cache, list(zip(slots, ([t] for t in tokens))), prompt=False)).float()
            for slot in slots:  # the same step again, natively, from the same cache
                cache.blocks.truncate_to(slot, cache.blocks.length(slot) - 1)
            model.step_runner = native
            got = torch.stack(model.run(cache, list(zip(slots, ([t] for t in tokens))), prompt=False)).float()
            tolerance = 2**-5 * float(want.abs().max())  # ten layers, rounded in different places
            torch.testing.assert_close(got, want, rtol=0, atol=tolerance)
            top = want.topk(2, dim=-1).values  # [B, 2]
            clear = (top[:, 0] - top[:, 1]) > 2 * tolerance
            assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
            tokens = want.argmax(-1).tolist()
    model.step_runner = None


@needs_kernel
def test_a_class_kept_against_eager_is_settled_against_its_compiled_graph(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Graphs deferred from the tuning cache: the native call is timed against eager at start-up,
    provisionally kept, then timed against each class's graph as it loads; only the settled
    decisions are stored, and a restart reuses them without timing. Timings are pinned."""
    model = int4_llama(1)
    cache = model.new_cache(token_budget=1024)
    times = {shape_key(shape): (4e-3, 2e-3) for shape in NATIVE_SHAPES}  # layers, native
    timed: list[tuple[Shape, ...]] = []

    def pinned(forward: PagedLlama, cache: object, runner: NativeSteps,
               shapes: tuple[Shape, ...] = NATIVE_SHAPES) -> dict[str, tuple[float, float]]:
        timed.append(shapes)
        return {shape_key(shape): times[shape_key(shape)] for shape in shapes}

    def loaded(runner: CompiledLayers, cache: object, shapes: list[Shape], *, timed: bool = False) -> dict[str, object]:
        runner.shapes.update(shape for shape in shapes if shape != (MANY, 2))  # that graph fails to build
        return {}

    monkeypatch.setattr(startup, "time_native_steps", pinned)
    monkeypatch.setattr(startup, "load_graphs", loaded)
    store = TuningStore(tmp_path)
    tuner = StartupTuner(store, TUNING_KEY)
    tuner.runner = CompiledLayers(model)  # the graphs `layer_path` defers
    tuner.pending = [(1, 1), (MANY, 1), (MANY, 2), (1, MULTI)]
    tuner.values["compiled_steps"] = {shape_key(shape): True for shape in tuner.pending}
    tuner.native_steps(model, cache, "auto", measure=True)
    runner = model.step_runner
    assert isinstance(runner, NativeSteps) and runner.shapes == set(NATIVE_SHAPES)
    assert tuner.native_unconfirmed == {"1x1", "2x1", "2x2", "1x3"} and "native_steps" not in tuner.values

    times["1x1"] = (1.5e-3, 2e-3)  # the compiled step beats the native one
    assert tuner.load_pending(cache)
    assert runner.shapes == set(NATIVE_SHAPES) - {(1, 1)} and "native_steps" not in tuner.values
    assert tuner.load_pending(cache)  # (MANY, 1): native stays
    # (MANY, 2)'s graph fails: it and (1, MULTI), whose graph will not load either, keep their
    # decisions against eager, and every class is settled.
    assert not tuner.load_pending(cache)
    assert tuner.values["native_steps"] == {shape_key(shape): shape != (1, 1) for shape in NATIVE_SHAPES}
    assert timed == [NATIVE_SHAPES, ((1, 1),), ((MANY, 1),)]

    model.step_runner = None
    restarted = StartupTuner(store, TUNING_KEY)
    restarted.native_steps(model, cache, "auto", measure=True)
    assert isinstance(model.step_runner, NativeSteps) and model.step_runner.shapes == set(NATIVE_SHAPES) - {(1, 1)}
    assert len(timed) == 3 and restarted.choices[-1].reason == "cached"




def test_the_library_builds_wherever_the_cpu_and_a_compiler_can_run_it() -> None:
    """Every other test here skips where int4dot is not available: a build broken by a change
    to the C++ must fail here instead of skipping them all."""
    if int4_dot.instruction_set() is None or not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no CPU or compiler the kernel builds for")
    assert int4_dot.available()
