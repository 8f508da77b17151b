"""The results document of one run: raw measurements plus the machine, as JSON.

Everything derived (speedups, α, c, s, S(K), efficiency) is recomputed from this file by
`specdec_bench.analysis`, so the plots and the page can be redrawn from a committed JSON
(`specdec bench --render-only`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from specdec.cost_model import ForwardCost
from specdec.v1 import gateway_pb2
from specdec_bench.burst import BurstRun
from specdec_bench.first_second import FirstSecondRun
from specdec_bench.peers import PeerRecord
from specdec_bench.step_timing import StepPair
from specdec_bench.structured import StructuredRun
from specdec_bench.sweeps import ConcurrencyGroup
from specdec_bench.workloads import RunRecord

SCHEMA_VERSION = 1


@dataclass
class ServiceCosts:
    """What the gateway's Info says about speculation and the services' measured forward costs."""

    target: list[ForwardCost]
    draft: list[ForwardCost]
    default_num_speculative_tokens: int
    max_speculative_tokens: int
    adaptive_k: bool
    target_model: str = ""
    target_dtype: str = ""
    draft_model: str = ""
    draft_dtype: str = ""
    draft_quantization: str = ""
    #: The draft's steps that ran compiled (`ModelInfo.compiled_steps`).
    draft_compiled_steps: list[str] = field(default_factory=list)
    #: The target's steps that ran compiled.
    target_compiled_steps: list[str] = field(default_factory=list)

    @classmethod
    def from_info(cls, info: gateway_pb2.GatewayInfo) -> ServiceCosts:
        def costs(model: Any) -> list[ForwardCost]:
            return [ForwardCost.from_pb(c) for c in model.forward_costs]

        return cls(
            target=costs(info.target), draft=costs(info.draft),
            default_num_speculative_tokens=info.default_num_speculative_tokens,
            max_speculative_tokens=info.max_speculative_tokens, adaptive_k=info.adaptive_k,
            target_model=info.target.model_name, target_dtype=info.target.dtype, draft_model=info.draft.model_name,
            draft_dtype=info.draft.dtype, draft_quantization=info.draft.quantization,
            draft_compiled_steps=list(info.draft.compiled_steps),
            target_compiled_steps=list(info.target.compiled_steps),
        )


@dataclass
class BenchResults:
    """One run: its settings, the machine, and every measurement."""

    meta: dict[str, Any]
    costs: ServiceCosts
    w1: list[RunRecord] = field(default_factory=list)
    peers: list[PeerRecord] = field(default_factory=list)
    k_sweep: list[RunRecord] = field(default_factory=list)
    concurrency: list[ConcurrencyGroup] = field(default_factory=list)
    #: 1-token draft and target steps timed in turn during W1 (`specdec_bench.step_timing`).
    step_pairs: list[StepPair] = field(default_factory=list)
    #: The drafting-method comparison on the copy-heavy, long-context and chat workloads.
    methods: list[RunRecord] = field(default_factory=list)
    #: Traffic from the first second (`specdec_bench.first_second`), with its own meta: `--first-second
    #: only` puts it into an earlier run's document.
    first_second: FirstSecondRun | None = None
    #: The noisy-neighbour burst (`specdec_bench.burst`), when the run measured it.
    burst: BurstRun | None = None
    #: The structured workload (`specdec_bench.structured`), when the run measured it.
    structured: StructuredRun | None = None

    def save(self, path: Path, summary: dict[str, Any] | None = None) -> None:
        """Write the document; `summary` (derived figures, for readers) is ignored by `load`."""
        path.parent.mkdir(parents=True, exist_ok=True)
        document = {"schema": SCHEMA_VERSION, **dataclasses.asdict(self), **({"summary": summary} if summary else {})}
        path.write_text(json.dumps(document, indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> BenchResults:
        raw = json.loads(path.read_text())
        if raw.get("schema") != SCHEMA_VERSION:
            raise ValueError(f"{path}: results schema {raw.get('schema')!r}, this harness reads {SCHEMA_VERSION}")
        costs = dict(raw["costs"])
        costs["target"] = [ForwardCost(**c) for c in costs["target"]]
        costs["draft"] = [ForwardCost(**c) for c in costs["draft"]]
        return cls(
            meta=raw["meta"],
            costs=ServiceCosts(**costs),
            w1=[RunRecord(**r) for r in raw["w1"]],
            peers=[PeerRecord(**r) for r in raw["peers"]],
            k_sweep=[RunRecord(**r) for r in raw["k_sweep"]],
            concurrency=[
                ConcurrencyGroup(g["concurrency"], g["k"], g["wall_s"], [RunRecord(**r) for r in g["requests"]])
                for g in raw["concurrency"]
            ],
            step_pairs=[StepPair(**p) for p in raw.get("step_pairs", [])],  # absent from runs before it existed
            methods=[RunRecord(**r) for r in raw.get("methods", [])],  # likewise
            first_second=FirstSecondRun.from_dict(raw["first_second"]) if raw.get("first_second") else None,
            burst=BurstRun.from_dict(raw["burst"]) if raw.get("burst") else None,
            structured=StructuredRun.from_dict(raw["structured"]) if raw.get("structured") else None,
        )


def lscpu() -> dict[str, str]:
    """`lscpu`'s fields by name (empty without lscpu)."""
    if shutil.which("lscpu") is None:
        return {}
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    return {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in out.splitlines()) if value}


def cpu_model() -> str:
    """The CPU as `lscpu` names it, with its logical CPU count: what every figure is quoted with."""
    fields = lscpu()
    return f"{fields.get('Model name', platform.processor() or 'unknown')}, {fields.get('CPU(s)', '?')} CPUs"


def git_revision() -> str:
    """The checkout's short commit, `+dirty` when it has changes; "" outside a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def machine() -> dict[str, Any]:
    """The CPU (model and flags from lscpu), core count and software versions."""
    cpu = lscpu()
    return {
        "cpu_model": cpu.get("Model name", platform.processor()),
        "cpu_flags": cpu.get("Flags", ""),
        "cpus": os.cpu_count(),
        "threads_per_core": cpu.get("Thread(s) per core", ""),
        "hypervisor": cpu.get("Hypervisor vendor", ""),
        #: 1, 5 and 15-minute load averages as the run ends: how crowded a shared machine was.
        "loadavg": [round(load, 2) for load in os.getloadavg()],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "git": git_revision(),
    }
