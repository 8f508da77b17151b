"""`make gpu-check`: every stage of the GPU check, each time-boxed, into one JSON and one line.

    python -m specdec_bench.gpu.check [--device cuda] [--small] [--out PATH] [--stages a,b]

Each stage (`specdec_bench.gpu.config.Stage`) runs in a process group of its own
(`specdec_bench.gpu.stages`) and is killed, services and all, when its time box ends; the time
a stage leaves unused passes to the next, so the whole never outlasts the sum of the boxes. A
stage that fails or hangs never stops the others. The JSON holds the device, the versions, the
commit, and per stage its status, seconds, error and figures; the last line printed sums it up.
`--small` is the CPU dry run: tiny random models, so every code path runs before a GPU sees it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import Any, TextIO

from specdec_bench.gpu.config import GPU, SMALL, GpuCheckConfig, Stage
from specdec_bench.gpu.record import Record, plain
from specdec_bench.gpu.summary import summary_line

SCHEMA_VERSION = 1
#: Seconds a stage's process group gets between SIGTERM and SIGKILL (the services stop gracefully).
KILL_GRACE_S = 5.0
#: Characters of a failed stage's log kept in the JSON.
LOG_TAIL_CHARS = 3000


class StageStatus(Enum):
    OK = "ok"
    FAILED = "failed"
    TIMED_OUT = "timed_out"


@dataclass(frozen=True)
class StagePlan:
    """One stage to run: its command line and the file it writes its figures to."""

    stage: Stage
    command: list[str]
    record: Path
    time_box_s: float


@dataclass
class StageResult:
    stage: Stage
    status: StageStatus
    seconds: float
    time_box_s: float
    error: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    log_tail: str = ""

    @property
    def ok(self) -> bool:
        return self.status is StageStatus.OK


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the stage's process group (the stage and the services it started), then SIGKILL
    what is left after a grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break  # the whole group is gone
        deadline = time.monotonic() + KILL_GRACE_S
        # poll() reaps the stage itself: a zombie still counts as a member of its group.
        while time.monotonic() < deadline and (process.poll() is None or _group_alive(process.pid)):
            time.sleep(0.1)
    process.wait()


def run_stage(plan: StagePlan, time_box_s: float, log: TextIO) -> StageResult:
    """Run one stage in a new session (so its whole process group can be stopped) for at most `time_box_s`."""
    log.write(f"\n===== {plan.stage.value} (time box {time_box_s:.0f} s) =====\n")
    log.flush()
    log_path = Path(log.name)
    start_offset = log_path.stat().st_size  # the log is opened for appending: the stage writes from here
    started = time.monotonic()
    process = subprocess.Popen(plan.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        code = process.wait(timeout=max(time_box_s, 1.0))
        status = StageStatus.OK if code == 0 else StageStatus.FAILED
    except subprocess.TimeoutExpired:
        status = StageStatus.TIMED_OUT
    _stop_group(process)  # also what a finished stage left running
    seconds = time.monotonic() - started
    figures = Record.read(plan.record)
    error = str(figures.pop("error", ""))
    if status is StageStatus.TIMED_OUT:
        error = f"still running at the end of its {time_box_s:.0f} s time box: stopped"
    elif status is StageStatus.FAILED and not error:
        error = f"exited with code {process.returncode}"
    log.flush()
    tail = "" if status is StageStatus.OK else _read_from(log_path, start_offset)[-LOG_TAIL_CHARS:]
    return StageResult(plan.stage, status, round(seconds, 1), round(time_box_s, 1), error, figures, tail)


def _read_from(path: Path, offset: int) -> str:
    with path.open("rb") as handle:
        handle.seek(offset)
        return handle.read().decode(errors="replace")


def run_stages(plans: Sequence[StagePlan], log: TextIO) -> list[StageResult]:
    """Every stage in turn; each may use its own box plus what the stages before it left unused."""
    started = time.monotonic()
    results = []
    budget_end = started
    for plan in plans:
        budget_end += plan.time_box_s
        result = run_stage(plan, budget_end - time.monotonic(), log)
        results.append(result)
        print(f"gpu-check: {plan.stage.value} {result.status.value} in {result.seconds:.0f} s"
              + (f": {result.error}" if result.error else ""), file=sys.stderr, flush=True)
    return results


def chosen_stages(names: str) -> list[Stage]:
    """The stages `--stages` names (comma-separated; all where it names none), in the check's
    order, always after the preflight: it names the device and pays the device's start-up,
    which would otherwise fall on the first stage's box."""
    named = {Stage(name.strip()) for name in names.split(",") if name.strip()}
    return [stage for stage in Stage if not named or stage in named or stage is Stage.PREFLIGHT]


def time_boxes(config: GpuCheckConfig, stages: Sequence[Stage]) -> dict[Stage, float]:
    """Each stage's box. A subset shares the whole check's time in proportion to its boxes:
    the boxes are sized for the whole check, where a stage also gets what the stages before it
    left unused, and a rerun of some stages should end within what the whole check takes."""
    whole = sum(config.time_box_s.values())
    part = sum(config.time_box_s[stage] for stage in stages)
    return {stage: config.time_box_s[stage] * whole / part for stage in stages}


def stage_plans(config: GpuCheckConfig, stages: Sequence[Stage], workdir: Path) -> list[StagePlan]:
    config_path = workdir / "config.json"
    config.save(config_path)
    boxes = time_boxes(config, stages)
    return [
        StagePlan(stage, [sys.executable, "-m", "specdec_bench.gpu.stages", stage.value, "--config", str(config_path),
                          "--record", str(workdir / f"{stage.value}.json")],
                  workdir / f"{stage.value}.json", boxes[stage])
        for stage in stages
    ]


def build_tiny_models(directory: Path) -> tuple[str, str]:
    """Two tiny random Llamas shaped like the random Llama-3.2 models (their vocabulary and
    tokenizer with its chat format, `llama3` RoPE, GQA, tied embeddings; 64 wide), drawn as
    `specdec.model.random_models` draws them and saved as model directories: a 2-layer
    target (seed 0) and a 1-layer draft (seed 1)."""
    import torch
    from transformers.utils import logging as hf_logging

    from specdec.model.loader import load_tokenizer
    from specdec.model.random_models import RandomArchitecture, build_random_model

    hf_logging.disable_progress_bar()
    tokenizer = load_tokenizer("random:llama-3.2-1b")
    paths = []
    for name, layers, seed in (("target", 2, 0), ("draft", 1, 1)):
        tiny = RandomArchitecture(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        path = directory / f"tiny-{name}"
        build_random_model(tiny, seed, dtype=torch.float32, device="cpu").save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(str(path))
    return paths[0], paths[1]


def commit(carry: Path) -> dict[str, str]:
    """The checkout's commit; where it is no git checkout (the GPU machine gets a copy of the
    tree), the one `make gpu-carry` recorded."""
    try:  # results imports torch, and the check writes its JSON even where torch is broken
        from specdec_bench.results import git_revision

        revision = git_revision()
    except ImportError:
        revision = ""
    if revision:
        return {"commit": revision, "commit_source": "git"}
    try:
        recorded = json.loads((carry / "manifest.json").read_text()).get("commit", "")
    except (OSError, ValueError):
        recorded = ""
    return {"commit": recorded, "commit_source": "make gpu-carry" if recorded else "unknown"}


def default_out() -> Path:
    """`$OUT/gpu_check.json` on the device machine, else under benchmarks/results/gpu/ (git-ignored)."""
    if out := os.environ.get("OUT"):
        return Path(out) / "gpu_check.json"
    return Path("benchmarks/results/gpu/gpu_check.json")


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m specdec_bench.gpu.check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="torch device (default: cuda; cpu with --small)")
    parser.add_argument("--small", action="store_true", help="the CPU dry run: tiny random models, tiny sizes")
    parser.add_argument("--out", type=Path, default=None, help=f"results JSON (default: {default_out()})")
    parser.add_argument("--stages", default="", help="comma-separated subset of: "
                        + ", ".join(stage.value for stage in Stage)
                        + " (the preflight always runs; the subset shares the whole check's time)")
    parser.add_argument("--carry", type=Path, default=Path(".gpu-carry"), help="the folder `make gpu-carry` filled")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _arguments(argv)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # the stages' weight-loading bars
    stages = chosen_stages(args.stages)
    out: Path = args.out or default_out()
    out.parent.mkdir(parents=True, exist_ok=True)
    config = SMALL if args.small else GPU
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        workdir = Path(tmp)
        if args.small:
            target, draft = build_tiny_models(workdir)
            config = dataclasses.replace(config, target_model=target, draft_model=draft)
        if args.device:
            config = dataclasses.replace(config, device=args.device)
        started = datetime.now(timezone.utc)
        log_path = out.with_suffix(".log")
        log_path.write_text("")
        with log_path.open("a") as log:  # appending: the stages write to the same file
            results = run_stages(stage_plans(config, stages, workdir), log)
    line = summary_line(config, results)
    document = {
        "schema": SCHEMA_VERSION, "command": " ".join(["python -m specdec_bench.gpu.check", *(argv or sys.argv[1:])]),
        "started": started.strftime("%Y-%m-%d %H:%M UTC"), **commit(args.carry), "config": config.to_json(),
        "environment": next((r.figures for r in results if r.stage is Stage.PREFLIGHT), {}),
        "stages": [dataclasses.asdict(r) for r in results], "summary": line,
    }
    out.write_text(json.dumps(plain(document), indent=1, allow_nan=False) + "\n")
    print(f"results: {out} (log: {log_path})", file=sys.stderr)
    print(line, flush=True)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
