"""Int8 activations for the draft's 4-bit matmuls (AVX-512 VNNI, as llama.cpp's Q4 x Q8 dot):
faster than the bf16 kernel, and what they cost in greedy agreement, side by side.

    .venv/bin/python benchmarks/experiments/int8_activations.py [--tokens 128] [--reps 15]

The kernel (`csrc/int4_vnni.cpp`, built here with torch's extension loader) takes the default
draft's packed weights as `specdec::int4_dot_mm` does and quantizes each row of x per weight
group to int8. Speed: every decoder matmul of the draft (30 layers x 4: q|k|v, o, gate|up,
down) in turn, as a step reads them, at 1-16 rows of random input; the minimum of `--reps`
passes for each kernel, interleaved (bf16, int8, bf16). Agreement: teacher-forced greedy
agreement with the fp32 target (as `quantized_draft.py` measures it) of the int4 draft with
every matmul on the bf16 kernel, then on the int8 one, over `quantized_draft.py`'s prompts and
over `specdec bench`'s chat prompts (W1), which differ here. Needs a CPU with AVX-512 BF16 and
VNNI.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from quantized_draft import PROMPTS, agreement, greedy_decode
from torch.utils import cpp_extension

from specdec.model import int4_dot
from specdec.model.chat import encode_chat
from specdec.model.quantize_int4 import Int4Linear
from specdec.model.runtime import build_runtime
from specdec_bench.workloads import PROMPTS as BENCH_PROMPTS

Matmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni"]


@contextmanager
def every_row_through(matmul: Matmul) -> Iterator[None]:
    """Every Int4Linear's forward, however many rows, through `matmul` on its int4dot operands."""
    def forward(self: Int4Linear, x: torch.Tensor) -> torch.Tensor:
        self.prepare(x.device, x.dtype)
        codes, sz = self.int4dot_operands()
        y = matmul(x.reshape(-1, self.in_features).contiguous(), codes, sz, self.group_size)  # [tokens, out]
        return y.reshape(*x.shape[:-1], self.out_features)

    original = Int4Linear.forward
    Int4Linear.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        Int4Linear.forward = original  # type: ignore[method-assign]


def pass_ms(layers: list[Int4Linear], matmul: Matmul, rows: int, reps: int) -> float:
    """The fastest of `reps` passes over `layers`, each on random input of `rows` rows."""
    inputs = {layer.in_features: torch.randn(rows, layer.in_features).to(torch.bfloat16) for layer in layers}
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        for layer in layers:
            matmul(inputs[layer.in_features], *layer.int4dot_operands(), layer.group_size)
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128, help="target tokens per prompt judged for agreement")
    parser.add_argument("--reps", type=int, default=15, help="timed passes per kernel and row count")
    args = parser.parse_args()
    ext = cpp_extension.load("int4_vnni", [str(Path(__file__).with_name("csrc") / "int4_vnni.cpp")],
                             extra_cflags=FLAGS)
    bf16: Matmul = int4_dot.int4_dot_mm
    int8: Matmul = ext.mm
    target = build_runtime("smollm2-135m", dtype="float32")
    draft = build_runtime("smollm2-135m", dtype="bfloat16", quantization="int4", int4_kernel="int4dot")
    layers = [m for layer in draft.model.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    if not all(isinstance(m, Int4Linear) and m.prepare(torch.device("cpu"), torch.bfloat16) == "int4dot"
               for m in layers):
        raise SystemExit("the draft's matmuls are not all int4dot layers")
    print(f"threads {torch.get_num_threads()}, {len(layers)} matmuls, group size {layers[0].group_size}")
    print("rows  bf16 ms  int8 ms  int8 / bf16")
    for rows in (1, 2, 4, 8, 16):
        first, int8_ms, second = (pass_ms(layers, kernel, rows, args.reps) for kernel in (bf16, int8, bf16))
        print(f"{rows:>4} {min(first, second):>8.2f} {int8_ms:>8.2f} {int8_ms / min(first, second):>12.2f}")
    tokenizer = target.loaded.tokenizer
    for prompt_set, texts in (("quantized_draft.py's prompts", PROMPTS), ("the bench's chat prompts", BENCH_PROMPTS)):
        judged: dict[str, list[float]] = {"bf16": [], "int8": []}
        for prompt in (encode_chat(tokenizer, [{"role": "user", "content": text}]) for text in texts):
            reference, _ = greedy_decode(target, prompt, args.tokens)
            for name, kernel in (("bf16", bf16), ("int8", int8)):
                with every_row_through(kernel):
                    judged[name].append(agreement(draft, prompt, reference))
        print(f"greedy agreement over {prompt_set} ({len(texts)} x {args.tokens} tokens): " + ", ".join(
            f"{name} activations {sum(values) / len(values):.3f}" for name, values in judged.items()))

if __name__ == "__main__":
    main()
