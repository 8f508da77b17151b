"""Where the default draft's 1-token step goes: torch's profiler over the draft service's own
Proposes, in process, built as `python -m specdec.draft_server` builds it.

    .venv/bin/python benchmarks/experiments/draft_step_profile.py [--context 128] [--k 16] [--rounds 8]

The engine comes from `build_engine` with the service's defaults (int4 weights, bf16
activations, kernels tuned, compiled steps where they measure faster), its deferred graphs
loaded before anything is timed. Each round rolls a slot back to a `--context`-token prompt
and proposes `--k` greedy tokens: one feed of the last prompt token, then one forward a token.
Printed: the step time a Propose gives (the seconds of a K-token Propose less a 1-token one,
over K - 1; medians of interleaved rounds), then the profiler's table of the K-token
Proposes, by operator, with each row's share of the steps' time, and the same in groups
(int4 matmuls, the compiled graphs' own code, their entries, the head's int8 rows,
allocations and views, other).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from specdec.draft_server.config import DraftConfig
from specdec.draft_server.engine import DraftEngine
from specdec.sampling.params import SamplingParams
from specdec.serving.model_service import build_engine
from specdec.wire.items import ProposeItem

GREEDY = SamplingParams(temperature=0.0)
#: Substrings of operator names, first match wins: the group each operator's time goes to.
#: A compiled graph's own code (norms, RoPE, attention, the cache writes) is one "Call
#: CompiledFxGraph" event; the int4 matmuls it calls out to are events of their own.
GROUPS = (
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=128, help="prompt tokens in the slot")
    parser.add_argument("--k", type=int, default=16, help="tokens a profiled Propose drafts")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds timed, and Proposes profiled")
    parser.add_argument("--rows", type=int, default=25, help="operators in the table")
    args = parser.parse_args()

    engine = build_engine(DraftEngine, DraftConfig(port=0, compile_budget_s=600.0))
    while engine.tuner.pending and engine.tuner.load_pending(engine.cache):
        pass
    print("compiled steps:", ", ".join(engine.tuner.compiled_steps(engine.model)) or "none")
    prompt = [(17 * i + 3) % 4000 + 100 for i in range(args.context)]
    engine.propose([ProposeItem("profile", 0, prompt, 1, GREEDY)])
    for _ in range(3):
        propose(engine, prompt, args.k)

    ones, longs = [], []
    for _ in range(args.rounds):
        ones.append(propose(engine, prompt, 1))
        longs.append(propose(engine, prompt, args.k))
    step_ms = (statistics.median(longs) - statistics.median(ones)) / (args.k - 1) * 1e3
    print(f"threads {torch.get_num_threads()}; 1-token Propose {statistics.median(ones) * 1e3:.2f} ms, "
          f"{args.k}-token {statistics.median(longs) * 1e3:.2f} ms: a step {step_ms:.2f} ms")

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
    for event in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True):
        groups[group_of(event.key)] += event.self_cpu_time_total
    for event in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.rows]:
        print(f"{event.key[:60]:60s} {event.count / steps:9.1f} {event.self_cpu_time_total / steps / 1e3:8.3f} "
              f"{event.self_cpu_time_total / total:6.1%}")
    print("\nby group:")
    for group, micros in sorted(groups.items(), key=lambda item: item[1], reverse=True):
        print(f"{group:44s} {micros / steps / 1e3:8.3f} ms {micros / total:6.1%}")
    print(f"operator events per forward: {sum(e.count for e in events) / steps:.0f}")


if __name__ == "__main__":
    main()
