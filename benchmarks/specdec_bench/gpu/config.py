"""What `make gpu-check` runs: its stages, their time boxes and sizes, for a GPU and for a CPU dry run.

`GPU` is the check as it runs on the lent GPU machine: the random-weight Llama-3.2 pair in
bf16, batches of 1, 8 and 32. `SMALL` (`--small`) runs every code path of it on a CPU in a few
minutes: tiny random models of the same shape family (built by `tiny_models`), fp32, tiny batches
and a couple of tokens. Each stage runs in its own process and is killed at its time box, so
the whole check ends within the sum of the boxes even if a stage hangs (`specdec_bench.gpu.check`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any


class Stage(Enum):
    """The stages, in the order they run (the most telling first)."""

    #: Versions, the device, what the carried packages resolve to, a copy-bandwidth probe.
    PREFLIGHT = "preflight"
    #: `pytest -m device_agnostic --device <device>`: our forward vs transformers, the
    #: rejection sampler and the KV cache on the device.
    DEVICE_TESTS = "device_tests"
    #: The three services in the speed dtype: greedy speculative vs plain, the share of
    #: (prompt, position) tokens that differ; a sampled request completes.
    GREEDY_PARITY = "greedy_parity"
    #: The same in the exact dtype, where speculative output must equal plain output.
    GREEDY_EXACT = "greedy_exact"
    #: The speed dtype again with the target's --batch-invariant: speculative output must equal
    #: plain output; its seconds against greedy_parity's are the mode's cost.
    GREEDY_INVARIANT = "greedy_invariant"
    #: In-process 1-token steps and (K+1)-token verifies of the target, against the
    #: memory-bandwidth roofline.
    STEP_SPEED = "step_speed"
    #: Through the services, the target drafting for itself: plain decode vs transformers'
    #: `generate`, efficiency against Theorem 3.8, aggregate tokens/s by concurrency.
    STACK_SPEED = "stack_speed"
    #: The draft service started with nothing but its model and device: the dtype,
    #: quantization and compiled steps it picks there, and how long it takes.
    SERVICE_DEFAULTS = "service_defaults"


#: Seconds each stage may run on the GPU machine; together under 7.7 minutes, so `make gpu-check`
#: (with its wheel install) ends inside the 8 minutes the issue allows. Sized from the runs on an
#: H200 (docs/gpu.md): a stage that starts services spends most of its box starting them.
GPU_TIME_BOX_S: dict[Stage, float] = {
    Stage.PREFLIGHT: 20, Stage.DEVICE_TESTS: 75, Stage.GREEDY_PARITY: 65, Stage.GREEDY_EXACT: 60,
    Stage.GREEDY_INVARIANT: 80, Stage.STEP_SPEED: 25, Stage.STACK_SPEED: 80, Stage.SERVICE_DEFAULTS: 55,
}
#: The dry run on 2 shared CPU cores: every service start-up imports torch and transformers.
SMALL_TIME_BOX_S: dict[Stage, float] = {
    Stage.PREFLIGHT: 60, Stage.DEVICE_TESTS: 120, Stage.GREEDY_PARITY: 150, Stage.GREEDY_EXACT: 150,
    Stage.GREEDY_INVARIANT: 150,
    Stage.STEP_SPEED: 60, Stage.STACK_SPEED: 300, Stage.SERVICE_DEFAULTS: 90,
}


@dataclass(frozen=True)
class GpuCheckConfig:
    """One run of the check. Model names are anything `--model` takes."""

    device: str = "cuda"
    target_model: str = "random:llama-3.2-3b"
    draft_model: str = "random:llama-3.2-1b"
    #: The dtype of the parity stage and of every speed figure.
    dtype: str = "bfloat16"
    #: The dtype in which speculative output must equal plain output token for token.
    exact_dtype: str = "float32"
    #: Batch sizes of the in-process step timing; K of its verify (K + 1 tokens a request).
    step_batches: tuple[int, ...] = (1, 8, 32)
    verify_k: int = 8
    #: Cached tokens of every request before the timed steps (a chat prompt and some output).
    step_context: int = 512
    step_warmup: int = 3
    step_repeats: int = 20
    #: Prompts and new tokens of the parity stage, and of the exact stage; K of their speculation.
    parity_prompts: int = 8
    parity_tokens: int = 32
    exact_prompts: int = 4
    exact_tokens: int = 24
    parity_k: int = 4
    #: The target's longest sequence in the batch-invariant stage: every step attends over this
    #: many key positions, so the mode's cost grows with it.
    invariant_max_seq_len: int = 1024
    #: The fixed Ks whose measured speedup is compared with Theorem 3.8, over `speed_prompts` prompts.
    speed_ks: tuple[int, ...] = (1, 4)
    speed_prompts: int = 3
    speed_tokens: int = 48
    #: Draft and target step pairs timed in turn for c (`specdec_bench.step_timing`).
    step_pairs: int = 8
    concurrency: tuple[int, ...] = (1, 8, 32)
    concurrency_tokens: int = 32
    #: K of the speculative side of the concurrency figures.
    concurrency_k: int = 4
    #: Only collect the device-agnostic tests (the CPU dry run: running them is the suite's job there).
    collect_tests_only: bool = False
    #: Extra flags of the draft in the service-defaults stage (on a GPU: none).
    defaults_extra_args: str = ""
    time_box_s: dict[Stage, float] = field(default_factory=lambda: dict(GPU_TIME_BOX_S))

    def to_json(self) -> dict[str, Any]:
        raw = dataclasses.asdict(self)
        raw["time_box_s"] = {stage.value: seconds for stage, seconds in self.time_box_s.items()}
        return raw

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> GpuCheckConfig:
        fields = dict(raw)
        for name in ("step_batches", "speed_ks", "concurrency"):
            fields[name] = tuple(fields[name])
        fields["time_box_s"] = {Stage(name): float(s) for name, s in fields["time_box_s"].items()}
        return cls(**fields)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: Path) -> GpuCheckConfig:
        return cls.from_json(json.loads(path.read_text()))


GPU = GpuCheckConfig()
#: The CPU dry run; its model names are replaced by the tiny models' directories at run time.
SMALL = GpuCheckConfig(
    device="cpu", dtype="float32", step_batches=(1, 2), verify_k=2, step_context=16, step_warmup=1,
    step_repeats=2, parity_prompts=2, parity_tokens=3, exact_prompts=1, exact_tokens=3, parity_k=2,
    speed_ks=(1, 2), speed_prompts=1, speed_tokens=3, step_pairs=1, concurrency=(1, 2), concurrency_tokens=2,
    concurrency_k=2, collect_tests_only=True, defaults_extra_args="--compile off --no-measure-costs",
    time_box_s=dict(SMALL_TIME_BOX_S),
)
