"""The stages of `make gpu-check`, each in a process of its own:
`python -m specdec_bench.gpu.stages <stage> --config CONFIG --record RECORD`.

A stage writes each figure to its record (`Record`) as soon as it has it, so a stage killed at
its time box (`specdec_bench.gpu.check`) keeps what it measured; a stage that fails exits 1
with the error in its record. The stages that run the services live in
`specdec_bench.gpu.services`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import math
import platform
import re
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import torch
import transformers

from specdec.cli.launcher import start_service
from specdec.model.loader import load_tokenizer
from specdec.model.runtime import build_runtime
from specdec.v1 import common_pb2, draft_pb2_grpc
from specdec_bench.gpu.config import GpuCheckConfig, Stage
from specdec_bench.gpu.record import Record, StageFailure
from specdec_bench.gpu.services import model_summary, service_pairs, stack_speed
from specdec_bench.gpu.steps import copy_bandwidth, nominal_bandwidth, time_steps, weight_bytes
from specdec_bench.results import lscpu
from specdec_bench.stack import wait_for_graphs

#: Distributions whose version and location the preflight reports: the carried ones may shadow
#: the machine's own, and which one a process imports decides whether the stubs load.
CARRIED_PACKAGES = ("grpcio", "protobuf", "grpcio-health-checking", "grpcio-reflection", "cryptography",
                    "transformers")
#: Longer than any stage's time box: the box, enforced from outside, is the real limit.
SERVICE_START_TIMEOUT_S = 600.0
#: Modules every service and the test suite import: a missing carried package fails here first.
REQUIRED_MODULES = (
    "specdec.v1.target_pb2_grpc", "specdec.v1.draft_pb2_grpc", "specdec.v1.gateway_pb2_grpc",
    "grpc_health.v1.health", "grpc_reflection.v1alpha.reflection", "cryptography.x509",
)


def _versions(name: str) -> list[dict[str, str]]:
    """Every installed copy of distribution `name`, in import order (the first one is imported)."""
    found = []
    for dist in importlib.metadata.distributions():
        if (dist.metadata["Name"] or "").lower() == name:
            found.append({"version": dist.version, "location": str(dist.locate_file(""))})
    return found


def _nvidia_driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


def preflight(config: GpuCheckConfig, record: Record) -> None:
    """Versions, the device, the carried packages in use, the copy bandwidth; then the imports
    and the tokenizer every other stage needs."""
    record.put("python", platform.python_version())
    record.put("torch", torch.__version__)
    record.put("torch_cuda", torch.version.cuda)
    record.put("transformers", transformers.__version__)
    record.put("float32_matmul_precision", torch.get_float32_matmul_precision())
    record.put("packages", {name: _versions(name) for name in CARRIED_PACKAGES})
    device = torch.device(config.device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        record.put("device", {
            "name": props.name, "capability": f"{props.major}.{props.minor}", "multiprocessors":
            props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30, 1),
            "cudnn": torch.backends.cudnn.version(), "driver": _nvidia_driver(),
        })
        record.put("nominal_bandwidth_bytes_per_s", nominal_bandwidth(props.name))
        record.put("copy_bandwidth_bytes_per_s", copy_bandwidth(device))
    else:
        record.put("device", {"name": lscpu().get("Model name", platform.processor()), "type": device.type})
    for module in REQUIRED_MODULES:
        importlib.import_module(module)
    record.put("imports", list(REQUIRED_MODULES))
    record.put("tokenizer_vocab", len(load_tokenizer("llama-3.2")))


def _pytest_counts(output: str) -> dict[str, int]:
    """The counts of pytest's last line: {"passed": 3, "skipped": 1} of "3 passed, 1 skipped in 2.0s";
    {"selected": 5, "collected": 9, "deselected": 4} of "5/9 tests collected (4 deselected) in 0.5s"."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    counts = {word: int(number) for number, word in re.findall(r"(\d+) ([a-z]+)", last) if word != "tests"}
    if (collected := re.search(r"(?:(\d+)/)?(\d+) tests? collected", last)) is not None:
        counts["collected"] = int(collected[2])
        counts["selected"] = int(collected[1] or collected[2])
    return counts


def device_tests(config: GpuCheckConfig, record: Record) -> None:
    """The device-agnostic tests on the check's device (only collected with `collect_tests_only`).
    pytest's output goes to the check's log as it comes, so a run stopped at its box shows how far it got."""
    collect_only = ["--collect-only"] if config.collect_tests_only else []
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
            "-m", "device_agnostic", "--device", config.device, *collect_only]
    record.put("command", shlex.join(argv[1:]))
    lines: list[str] = []
    started = time.monotonic()
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as pytest:
        assert pytest.stdout is not None
        for line in pytest.stdout:
            print(line, end="", flush=True)
            lines.append(line.strip())
            if _pytest_counts(line):  # when the summary came, against when pytest exited (below)
                record.put("summary_s", time.monotonic() - started)
    record.put("exit_s", time.monotonic() - started)
    record.put("exit_code", pytest.returncode)
    record.put("counts", _pytest_counts("\n".join(lines)))
    if pytest.returncode != 0:
        said = [line for line in lines if line]
        # argparse's "...: error: unrecognized arguments" before pytest's "ERROR: usage" line, else the summary.
        reason = next((line for line in said if ": error:" in line), said[-1] if said else "(no output)")
        raise StageFailure(f"pytest exited with {pytest.returncode}: {reason}")


def greedy_parity(config: GpuCheckConfig, record: Record) -> None:
    """Speed dtype: the share of tokens where greedy speculative and plain output differ (reported,
    not required to be 0: bf16 rounds differently across chunk widths); a sampled request completes."""
    service_pairs(config, record, config.dtype, prompts=config.parity_prompts, max_new_tokens=config.parity_tokens,
                  sampled=True)


def greedy_exact(config: GpuCheckConfig, record: Record) -> None:
    """Exact dtype: greedy speculative output must equal plain output, token for token."""
    comparison = service_pairs(config, record, config.exact_dtype, prompts=config.exact_prompts,
                               max_new_tokens=config.exact_tokens, sampled=False)
    if comparison.mismatched_tokens:
        raise StageFailure(f"{config.exact_dtype}: greedy speculative output differs from plain output in "
                           f"{comparison.diverged_prompts} of {comparison.prompts} prompts "
                           f"(first at token {comparison.first_mismatch()})")


def greedy_invariant(config: GpuCheckConfig, record: Record) -> None:
    """Speed dtype with the target's --batch-invariant (one fixed step shape: K_max = the parity
    K, one request a step): speculative output must equal plain output; the requests' seconds,
    set beside greedy_parity's, are what the mode costs."""
    k = config.parity_k
    flags = (f"--batch-invariant --invariant-batch 1 --max-speculative-tokens {k} "
             f"--max-seq-len {config.invariant_max_seq_len}", f"--num-speculative-tokens {k}")
    comparison = service_pairs(config, record, config.dtype, prompts=config.parity_prompts,
                               max_new_tokens=config.parity_tokens, sampled=False, extra=flags)
    if comparison.mismatched_tokens:
        raise StageFailure(f"{config.dtype} --batch-invariant: greedy speculative output differs from plain output "
                           f"in {comparison.diverged_prompts} of {comparison.prompts} prompts "
                           f"(first at token {comparison.first_mismatch()})")


def step_speed(config: GpuCheckConfig, record: Record) -> None:
    """The target's 1-token step and (K+1)-token verify in-process, eager and from CUDA graphs,
    with the roofline fraction."""
    runtime = build_runtime(config.target_model, dtype=config.dtype, device=config.device)
    forward = runtime.model
    device = forward.embed_tokens.weight.device
    weights = weight_bytes(runtime.loaded.model)
    record.put("model", {"name": runtime.loaded.name, "dtype": config.dtype, "weight_bytes": weights})
    bandwidth = nominal_bandwidth(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    roofline_s = weights / bandwidth if bandwidth else math.nan
    record.put("roofline", {
        "bandwidth_bytes_per_s": bandwidth, "step_s": roofline_s,
        "assumption": "roofline = weight bytes / the device's nominal (datasheet) memory bandwidth, by its name; "
                      "KV-cache and activation traffic not counted",
    })
    widths = (1, config.verify_k + 1)
    # Eager first, then as the services run steps on CUDA: padded, replayed from CUDA graphs.
    for key, graphs in (("steps", False), ("graph_steps", True)):
        timings = time_steps(forward, batches=config.step_batches, widths=widths, context=config.step_context,
                             warmup=config.step_warmup, repeats=config.step_repeats, graphs=graphs)
        seconds = {(t.batch, t.tokens): t.seconds for t in timings}
        rows = []
        for batch in config.step_batches:
            step, verify = seconds[(batch, 1)], seconds[(batch, widths[1])]
            rows.append({
                "batch": batch, "context": config.step_context, "step_s": step, "verify_tokens": widths[1],
                "verify_s": verify, "verify_over_step": verify / step, "step_tokens_per_s": batch / step,
                "step_roofline_fraction": roofline_s / step,
            })
        record.put(key, rows)


def service_defaults(config: GpuCheckConfig, record: Record) -> None:
    """The draft service with only its model and device given: what it picks and how long it
    takes to serve, then to load the compiled graphs its start-up left for later (the stage's
    time box is the limit). On CUDA it must pick bf16 and no quantization (the int4 path
    dequantizes at every call there)."""
    args = ["--model", config.draft_model, "--device", config.device, *shlex.split(config.defaults_extra_args)]
    record.put("flags", shlex.join(args))
    started = time.monotonic()
    service = start_service("specdec.draft_server", [*args, "--log-level", "WARNING"])
    try:
        service.wait_ready(timeout=SERVICE_START_TIMEOUT_S)
        record.put("ready_s", time.monotonic() - started)
        info = _model_info(service.address)
        record.put("model_info", info)
        wrong = _wrong_defaults(config.device, info)
        if not wrong:
            wait_for_graphs(service.address, "draft", timeout=SERVICE_START_TIMEOUT_S)
            record.put("graphs_ready_s", time.monotonic() - started)
            record.put("compiled_steps", _model_info(service.address)["compiled_steps"])
    finally:
        service.stop()
    if wrong:
        raise StageFailure(wrong)


def _wrong_defaults(device: str, info: dict[str, Any]) -> str:
    """What is wrong with the precision a service picked by itself on `device` ("" if nothing)."""
    if torch.device(device).type == "cuda" and (info["dtype"], info["quantization"]) != ("bfloat16", "none"):
        return f"on CUDA the draft's defaults are {info['dtype']} / {info['quantization']}, expected bfloat16 / none"
    return ""


def _model_info(address: str) -> dict[str, Any]:
    with grpc.insecure_channel(address) as channel:
        info = draft_pb2_grpc.DraftServiceStub(channel).Info(common_pb2.InfoRequest(), timeout=30)
    return {
        **model_summary(info), "compiled_steps": list(info.compiled_steps), "pending_graphs": info.pending_graphs,
        # Each choice with what decided it: on CUDA, compiled steps turn the CUDA graphs off, and
        # the detail holds the eager and compiled step times the choice rested on.
        "tuning": {choice.name: {"value": choice.value, "reason": choice.reason, "detail": choice.detail}
                   for choice in info.tuning},
    }


STAGES: dict[Stage, Callable[[GpuCheckConfig, Record], None]] = {
    Stage.PREFLIGHT: preflight, Stage.DEVICE_TESTS: device_tests, Stage.GREEDY_PARITY: greedy_parity,
    Stage.GREEDY_EXACT: greedy_exact, Stage.GREEDY_INVARIANT: greedy_invariant,
    Stage.STEP_SPEED: step_speed, Stage.STACK_SPEED: stack_speed,
    Stage.SERVICE_DEFAULTS: service_defaults,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec_bench.gpu.stages", description=__doc__)
    parser.add_argument("stage", choices=[stage.value for stage in Stage])
    parser.add_argument("--config", type=Path, required=True, help="the check's config (JSON)")
    parser.add_argument("--record", type=Path, required=True, help="where the stage writes its figures (JSON)")
    args = parser.parse_args(argv)
    record = Record(args.record)
    try:
        STAGES[Stage(args.stage)](GpuCheckConfig.load(args.config), record)
    except Exception as error:  # noqa: BLE001 -- whatever broke is the stage's result, written down
        traceback.print_exc()
        record.put("error", f"{type(error).__name__}: {error}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
