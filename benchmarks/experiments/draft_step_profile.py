"""Where the default draft's 1-token step goes: torch's profiler over the draft service's own
Proposes, in process, built as `python -m specdec.draft_server` builds it.

    .venv/bin/python benchmarks/experiments/draft_step_profile.py [--context 128] [--k 16] [--rounds 8]
        [--native-steps on|off]

The engine comes from `build_engine` with the service's defaults (int4 weights, bf16
activations, kernels tuned, compiled steps where they measure faster) and the native 1-token
step built, its deferred graphs loaded before anything is timed. Each round rolls a slot back
to a `--context`-token prompt and proposes `--k` greedy tokens: one feed of the last prompt
token, then one forward a token. Printed: the step time a Propose gives (the seconds of a
K-token Propose less a 1-token one, over K - 1; medians of interleaved rounds), through the
compiled layers and through the native step side by side; then, for the path `--native-steps`
names, the profiler's table of the K-token Proposes, by operator, with each row's share of the
steps' time, and the same in groups (the native call, int4 matmuls, the compiled graphs' own
code, their entries, the head's int8 rows, allocations and views, other). Last, the int4
kernel alone per weight shape, 1 row, every layer's matrix of that shape in turn as a step
reads them: ms a call, GB/s of codes and scales read, and how evenly its blocks of 64 outputs
split over the threads.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from specdec.draft_server.config import DraftConfig
from specdec.draft_server.engine import DraftEngine
from specdec.model.int4_dot import OUT_BLOCK
from specdec.model.quantize_int4 import Int4Linear, kernel_matmul
from specdec.sampling.params import SamplingParams
from specdec.serving.model_service import build_engine
from specdec.wire.items import ProposeItem

GREEDY = SamplingParams(temperature=0.0)
#: Substrings of operator names, first match wins: the group each operator's time goes to.
#: A compiled graph's own code (norms, RoPE, attention, the cache writes) is one "Call
#: CompiledFxGraph" event; the int4 matmuls it calls out to are events of their own.
GROUPS = (
    ("native decoder layers (one call a step)", ("decode_layers",)),
    ("int4 matmuls (decoder, head's 4-bit pass)", ("int4",)),
    ("compiled graphs' code", ("CompiledFxGraph",)),
    ("graph entries (dynamo, AOT wrappers)", ("Torch-Compiled", "TorchDynamo", "Pregraph", "AOTDispatcher")),
    ("output head's int8 rows, draw", ("int8", "shortlist", "_int_mm", "topk", "argmax")),
    ("allocations and views", ("empty", "as_strided", "transpose", "view", "expand", "aten::to", "_to_copy")),
)


def group_of(name: str) -> str:
    lowered = name.lower()
    return next((group for group, keys in GROUPS if any(key.lower() in lowered for key in keys)), "other")


def propose(engine: DraftEngine, prompt: list[int], k: int) -> float:
    """Seconds of a `k`-token greedy Propose after rolling the slot back to `prompt`."""
    started = time.perf_counter()
    engine.propose([ProposeItem("profile", len(prompt) - 1, prompt[-1:], k, GREEDY)])
    return time.perf_counter() - started


def kernel_table(engine: DraftEngine, repeats: int) -> None:
    """The int4 kernel per weight shape at 1 row (see the module docstring)."""
    by_shape: dict[tuple[int, int], list[Int4Linear]] = defaultdict(list)
    forward = engine.model
    matmuls = [m for layer in forward.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    matmuls += list(forward.lm_head.modules()) if isinstance(forward.lm_head, torch.nn.Module) else []
    for module in matmuls:
        if isinstance(module, Int4Linear) and module.kernel == "int4dot":
            by_shape[(module.out_features, module.in_features)].append(module)
    threads = torch.get_num_threads()
    print(f"\nint4dot per shape, 1 row, {threads} threads:")
    print(f"{'out x in':>12s} {'layers':>6s} {'ms/call':>8s} {'GB/s':>6s} {'split':>6s}")
    for (out, inputs), modules in sorted(by_shape.items()):
        x = torch.randn(1, inputs, dtype=torch.bfloat16)
        operands = [m.int4dot_operands() for m in modules]
        nbytes = sum(t.numel() * t.element_size() for t in operands[0])
        for ops, module in zip(operands, modules):
            kernel_matmul("int4dot", x, ops, module.group_size)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            for ops, module in zip(operands, modules):
                kernel_matmul("int4dot", x, ops, module.group_size)
            times.append((time.perf_counter() - started) / len(modules))
        seconds = min(times)
        blocks = out // OUT_BLOCK
        split = blocks / threads / math.ceil(blocks / threads)  # 1.0: every thread as busy
        print(f"{out:>5d} x {inputs:<5d} {len(modules):6d} {seconds * 1e3:8.3f} {nbytes / seconds / 1e9:6.1f} "
              f"{split:6.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=128, help="prompt tokens in the slot")
    parser.add_argument("--k", type=int, default=16, help="tokens a profiled Propose drafts")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds timed, and Proposes profiled")
    parser.add_argument("--rows", type=int, default=25, help="operators in the table")
    parser.add_argument("--native-steps", choices=("on", "off"), default="on",
                        help="profile the native 1-token step or the compiled layers (both are timed)")
    args = parser.parse_args()

    engine = build_engine(DraftEngine, DraftConfig(port=0, compile_budget_s=600.0, native_steps="on"))
    while engine.tuner.pending and engine.tuner.load_pending(engine.cache):
        pass
    print("compiled steps:", ", ".join(engine.tuner.compiled_steps(engine.model)) or "none")
    prompt = [(17 * i + 3) % 4000 + 100 for i in range(args.context)]
    engine.propose([ProposeItem("profile", 0, prompt, 1, GREEDY)])
    native = engine.model.step_runner
    paths = {"compiled layers": None, "native step": native} if native is not None else {"compiled layers": None}
    ones: dict[str, list[float]] = defaultdict(list)
    longs: dict[str, list[float]] = defaultdict(list)
    for round_ in range(args.rounds + 3):  # the first three warm up
        for name, runner in paths.items():
            engine.model.step_runner = runner
            one, long = propose(engine, prompt, 1), propose(engine, prompt, args.k)
            if round_ >= 3:
                ones[name].append(one)
                longs[name].append(long)
    for name in paths:
        step_ms = (statistics.median(longs[name]) - statistics.median(ones[name])) / (args.k - 1) * 1e3
        print(f"{name}: threads {torch.get_num_threads()}; 1-token Propose {statistics.median(ones[name]) * 1e3:.2f} "
              f"ms, {args.k}-token {statistics.median(longs[name]) * 1e3:.2f} ms: a step {step_ms:.2f} ms")
    engine.model.step_runner = native if args.native_steps == "on" else None

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.rounds):
            propose(engine, prompt, args.k)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    steps = args.rounds * args.k
    print(f"\nself CPU time by operator, per forward ({steps} forwards, {total / steps / 1e3:.2f} ms each "
          "on the calling thread's clock):")
    print(f"{'operator':60s} {'calls/fwd':>9s} {'ms/fwd':>8s} {'share':>6s}")
    groups: dict[str, float] = defaultdict(float)
    for event in events:
        groups[group_of(event.key)] += event.self_cpu_time_total
    for event in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.rows]:
        print(f"{event.key[:60]:60s} {event.count / steps:9.1f} {event.self_cpu_time_total / steps / 1e3:8.3f} "
              f"{event.self_cpu_time_total / total:6.1%}")
    print("\nby group:")
    for group, micros in sorted(groups.items(), key=lambda item: item[1], reverse=True):
        print(f"{group:44s} {micros / steps / 1e3:8.3f} ms {micros / total:6.1%}")
    print(f"operator events per forward: {sum(e.count for e in events) / steps:.0f}")
    kernel_table(engine, args.rounds * 4)


if __name__ == "__main__":
    main()
