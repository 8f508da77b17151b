"""Start-up measurements of the matmul kernels: int4, the output head and dense layers.

Each times its candidates with `interleaved_times` on this machine's device and keeps the
minimum of each: a microbenchmark's noise only adds time, and close kernels rank by their
best. The CPU kernel choices are timed on one intra-op thread (`one_thread`): per-core speed
ranks them, and a second thread only adds another process's stalls to the comparison.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specdec.model import int4_dot
from specdec.model.int4_weight import Int4Weight
from specdec.model.linear import MAX_NARROW_ROWS, onednn_linear, onednn_packed
from specdec.model.quantize import Int8Linear
from specdec.model.quantize_int4 import Int4Linear, kernel_matmul, kernel_operands
from specdec.model.shortlist_head import ShortlistHead
from specdec.tuning.threads import one_thread
from specdec.tuning.timing import interleaved_times, synchronizer

log = logging.getLogger(__name__)

#: Interleaved timed rounds of each kernel measurement: each is well under a millisecond, and
#: close kernels need enough rounds for each to show its best.
REPEATS = 25
#: Rows the dense benchmark times for narrow inputs (a decode step, a verify chunk) and wide ones.
NARROW_ROWS = (1, 5)
WIDE_ROWS = (64,)
#: Rows the int4 benchmark times: a decode step, a step of 4 requests, and a forward with a
#: guess (the draft's own lookups feed up to 8 guessed tokens a step), where kernels that tie
#: at 1 and 4 rows differed by a fifth (docs/performance.md#a-long-prompts-catch-up).
INT4_ROWS = (1, 4, 9)


def int4_candidates(dtype: torch.dtype) -> list[str]:
    """The 4-bit kernels that can run on this CPU for activations of `dtype`, besides "dequant"."""
    names = ["int4dot"] if dtype == torch.bfloat16 and int4_dot.available() else []
    return names + (["int4pack"] if hasattr(torch, "_weight_int4pack_mm_for_cpu") else [])


def measure_int4_kernels(dtype: torch.dtype) -> dict[str, float]:
    """Seconds of a decode-shaped workload on each int4 kernel that runs on this CPU and gives
    the reference's results: `INT4_ROWS` rows through four 1024->1024 layers (16 MB of fp32
    weights, so the float path is not timed from a warm L2 cache)."""
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(4):
        q = torch.randint(0, 16, (1024, 1024), dtype=torch.uint8, generator=gen)  # [out, in]
        scales = torch.rand(1024, 1024 // 32, generator=gen) * 0.01 + 0.001  # [out, groups]
        layers.append(Int4Weight(q, scales, -8 * scales, 32))
    x = torch.randn(max(INT4_ROWS), 1024, generator=gen).to(dtype)  # [rows, in]
    want = F.linear(x.float(), layers[0].dequantize())  # [rows, out]
    cpu = torch.device("cpu")
    runs: dict[str, Callable[[], None]] = {}
    for name in ["dequant", *int4_candidates(dtype)]:
        try:
            operands = [kernel_operands(name, w, dtype, cpu) for w in layers]
            got = kernel_matmul(name, x, operands[0], 32).float()  # [rows, out]
        except (RuntimeError, NotImplementedError) as exc:
            log.info("int4 kernel for cpu/%s: %s unavailable (%s)", dtype, name, exc)
            continue
        if not torch.allclose(got, want, rtol=3e-2, atol=3e-2 * float(want.abs().max())):
            log.warning("int4 kernel for cpu/%s: %s gives wrong results; not used", dtype, name)
            continue
        runs[name] = functools.partial(_run_layers, name, x, operands)
    with one_thread(), torch.inference_mode():
        return interleaved_times(runs, repeats=REPEATS, statistic=min)


def measure_int4_wide(module: Int4Linear, dtype: torch.dtype) -> dict[str, float]:
    """Seconds of a wide input (`WIDE_ROWS`: a draft catching up on a prompt) through this
    layer's own weight on its decode kernel and on "dequant" (a dense matmul, which the CPU's
    bf16 units run faster once the rows are many)."""
    weight = module.int4_weight()
    x = torch.randn(max(WIDE_ROWS), module.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    cpu = torch.device("cpu")
    kernels = {module.prepare(cpu, dtype), "dequant"}
    operands = {name: kernel_operands(name, weight, dtype, cpu) for name in kernels}
    runs = {name: functools.partial(kernel_matmul, name, x, operands[name], weight.group_size) for name in kernels}
    with torch.inference_mode():
        return interleaved_times(runs, repeats=REPEATS, statistic=min)


def _run_layers(kernel: str, x: torch.Tensor, operands: list[tuple[torch.Tensor, ...]]) -> None:
    for rows in INT4_ROWS:
        for ops in operands:
            kernel_matmul(kernel, x[:rows], ops, 32)


def measure_head(exact: Int8Linear, candidate: ShortlistHead) -> dict[str, float]:
    """Seconds of one and four rows through the int8 head ("int8") and the shortlist head
    ("shortlist")."""
    x = torch.randn(4, exact.in_features, generator=torch.Generator().manual_seed(0))
    x = x.to(device=exact.weight_int8.device, dtype=exact.scales.dtype)  # [rows, in]
    heads: dict[str, nn.Module] = {"int8": exact, "shortlist": candidate}
    runs = {name: functools.partial(_one_and_four_rows, head, x) for name, head in heads.items()}
    with one_thread(), torch.inference_mode():
        return interleaved_times(runs, repeats=REPEATS, sync=synchronizer(x.device), statistic=min)


def _one_and_four_rows(head: nn.Module, x: torch.Tensor) -> None:
    head(x[:1])
    head(x)


def measure_dense(weight: torch.Tensor) -> tuple[str, str]:
    """The faster of `F.linear` ("aten") and oneDNN with a packed weight for this weight's
    shape, for narrow and for wide inputs (`specdec.model.linear`); "aten" for both where
    oneDNN cannot take it. Timed on the weight itself: values do not change the speed, and a
    random stand-in of an output head's size takes long just to generate."""
    packed = onednn_packed(weight)
    if packed is None:
        return "aten", "aten"
    chosen = []
    for rows in (NARROW_ROWS, WIDE_ROWS):
        inputs = [torch.randn(n, weight.shape[1], dtype=weight.dtype) for n in rows]  # [rows, in] each
        runs = {
            "aten": functools.partial(_each, lambda x: F.linear(x, weight), inputs),
            "onednn": functools.partial(_each, lambda x: onednn_linear(x, packed), inputs),
        }
        with torch.inference_mode():
            times = interleaved_times(runs, repeats=REPEATS, statistic=min)
        chosen.append(min(times, key=times.__getitem__))
    assert max(NARROW_ROWS) <= MAX_NARROW_ROWS < min(WIDE_ROWS)
    return chosen[0], chosen[1]


def _each(fn: Callable[[torch.Tensor], torch.Tensor], inputs: list[torch.Tensor]) -> None:
    for x in inputs:
        fn(x)
