"""What the sampling transforms cost a verify: the target's p for 16 sampled requests x (K + 1)
positions (`chunk_logits_to_probs`) and the draft's q for one step (`logits_to_probs`), with
and without the logit bias, presence / frequency penalties and min-p, against another revision
of `specdec/sampling/transforms.py` side by side.

    PYTHONPATH=. .venv/bin/python benchmarks/experiments/sampling_step.py [--baseline REV] [--requests 16] [--k 8]

Workloads: `plain` (temperature 0.8: none of the new fields), `top-p` (plus top-p 0.95, whose
sort dominates), `repetition` (plain plus a repetition penalty of 1.1) and `all` (repetition plus
min-p 0.05, a 3-token logit bias, presence 0.5 and frequency 0.3; the baseline cannot run it).
Each slot holds `--context` tokens, the output starting halfway. One thread, as the target
samples (`one_thread`); the revisions alternate call by call. Prints the median and p90
milliseconds per call and the CPU model.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

from specdec.sampling import transforms
from specdec.sampling.params import SamplingParams
from specdec_bench.results import cpu_model

WORKLOADS = {
    "plain": SamplingParams(temperature=0.8),
    "top-p": SamplingParams(temperature=0.8, top_p=0.95),
    "repetition": SamplingParams(temperature=0.8, repetition_penalty=1.1),
    "all": SamplingParams(temperature=0.8, repetition_penalty=1.1, min_p=0.05,
                          logit_bias=((11, 2.0), (220, -100.0), (1000, 0.5)), presence_penalty=0.5,
                          frequency_penalty=0.3),
}


def module_at(revision: str) -> types.ModuleType:
    """`specdec/sampling/transforms.py` as it was at `revision`, imported under another name."""
    source = subprocess.run(["git", "show", f"{revision}:specdec/sampling/transforms.py"], capture_output=True,
                            text=True, check=True).stdout
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "transforms.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(f"transforms_{revision}", path)
        if spec is None or spec.loader is None:
            raise RuntimeError(f"cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
    return module


def timed(call: Callable[..., object], *args: object) -> float:
    """Milliseconds of one call(*args)."""
    started = time.perf_counter()
    call(*args)
    return (time.perf_counter() - started) * 1000


def compare(modules: dict[str, types.ModuleType], params: list[SamplingParams], calls: int,
            chunk_logits: torch.Tensor, context: list[list[int]], drafts: list[list[int]]) -> dict[str, list[str]]:
    """Each module's verify (K + 1 positions) and draft (one position) calls, alternating;
    per module the median and p90 of each, formatted."""
    runs: dict[str, dict[str, list[float]]] = {m: {"verify": [], "draft": []} for m in modules}
    step_logits = chunk_logits[:, 0].contiguous()  # [n, vocab]
    for _ in range(calls):
        for label, module in modules.items():
            runs[label]["verify"].append(timed(module.chunk_logits_to_probs, chunk_logits, params, context, drafts))
            runs[label]["draft"].append(timed(module.logits_to_probs, step_logits, params, context))
    return {label: [f"{step} {statistics.median(ms):.2f} ms (p90 {statistics.quantiles(ms, n=10)[-1]:.2f})"
                    for step, ms in steps.items()] for label, steps in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="", help="git revision to compare with (default: none)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=49_152)
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    n = args.requests
    chunk_logits = torch.randn(n, args.k + 1, args.vocab, generator=g) * 3  # [n, K+1, vocab]
    context = torch.randint(0, args.vocab, (n, args.context), generator=g).tolist()
    drafts = torch.randint(0, args.vocab, (n, args.k), generator=g).tolist()
    modules = {"current": transforms} | ({args.baseline: module_at(args.baseline)} if args.baseline else {})
    print(f"CPU: {cpu_model()}; {n} requests x K={args.k}, vocab {args.vocab}, context {args.context}, 1 thread")
    for name, base in WORKLOADS.items():
        params = [dataclasses.replace(base, penalty_start=args.context // 2)] * n
        usable = {label: m for label, m in modules.items() if label == "current" or name != "all"}
        for label, cells in compare(usable, params, args.calls, chunk_logits, context, drafts).items():
            print(f"{name:>10} {label:>10}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
