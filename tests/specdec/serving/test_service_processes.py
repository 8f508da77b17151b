"""`python -m specdec.draft_server` and `python -m specdec.target_server` as real processes.

Both start at once on port 0 with their default models (fp32 target, int8 + bf16 draft),
announce "<name> listening on host:port", answer Info, the standard health check and
server reflection, serve a real model call on OpenMP threads bound one per core, and exit
cleanly on SIGTERM.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from specdec.draft_server.server import SERVICE_NAME as DRAFT_SERVICE
from specdec.serving.ready import parse_ready_line
from specdec.target_server.server import SERVICE_NAME as TARGET_SERVICE
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specdec.wire.tensor_codec import decode_tensor

STARTUP_TIMEOUT_S = 240.0  # two model loads sharing two busy cores
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# Nothing timed at start-up and no tuning cache read: start-up takes as long on any machine.
FLAGS = ["--port", "0", "--kv-token-budget", "256", "--max-slots", "4", "--max-speculative-tokens", "4",
         "--compile", "off", "--no-measure-costs", "--no-tuning-cache", "--no-tune-kernels"]


class ServiceProcess:
    """A service started with `python -m <module>`; stdout lines are collected by a thread."""

    def __init__(self, module: str, log_dir: Path) -> None:
        self.module = module
        self.stderr_path = log_dir / f"{module}.stderr"
        with self.stderr_path.open("wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, *FLAGS], cwd=log_dir, stdout=subprocess.PIPE, stderr=stderr,
                text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"{module}-stdout", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_ready(self, deadline: float) -> tuple[str, int]:
        """(host, port) from the ready line."""
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"{self.module} did not report ready in time:\n{self.stderr()}")
            if line is None:
                pytest.fail(f"{self.module} exited with {self.proc.wait()} before ready:\n{self.stderr()}")
            if ready := parse_ready_line(line):
                assert ready.name == self.module.removeprefix("specdec.")
                host, port = ready.address.rsplit(":", 1)
                return host, int(port)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-4000:]


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[[str], ServiceProcess]]:
    started: list[ServiceProcess] = []

    def start(module: str) -> ServiceProcess:
        process = ServiceProcess(module, tmp_path)
        started.append(process)
        return process

    yield start
    for process in started:  # only if a test failed before its own clean shutdown
        if process.proc.poll() is None:
            process.proc.kill()
            process.proc.wait(timeout=30)


def check_health_and_reflection(channel: grpc.Channel, service_name: str) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", service_name):
        reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as unknown:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

    listed = health.List(health_pb2.HealthListRequest(), timeout=10).statuses
    assert listed[service_name].status == health_pb2.HealthCheckResponse.SERVING and "" in listed

    database = ProtoReflectionDescriptorDatabase(channel)
    assert {service_name, HEALTH_SERVICE} <= set(database.get_services())
    methods = {m.name for m in descriptor_pool.DescriptorPool(database).FindServiceByName(service_name).methods}
    assert {"Info", "Truncate", "Release"} <= methods
    # Reflection v1, which current grpcurl and grpc-js try first, answers the same.
    v1 = channel.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    replies = list(v1(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
    assert service_name in {s.name for s in replies[0].list_services_response.service}


def check_forward_thread_bound(pid: int) -> None:
    """The entry point bound the OpenMP threads (`thread_placement`): after a model call the
    thread that runs the forward is pinned to one core, the main thread is not."""
    every = os.sched_getaffinity(pid)
    if len(every) < 2:
        return
    pinned = [tid for tid in map(int, os.listdir(f"/proc/{pid}/task")) if os.sched_getaffinity(tid) < every]
    assert pinned and pid not in pinned


def test_entry_points_serve_health_reflection_and_stop_on_sigterm(launch: Callable[[str], ServiceProcess]) -> None:
    draft, target = launch("specdec.draft_server"), launch("specdec.target_server")
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    addresses = {p.module: p.wait_ready(deadline) for p in (draft, target)}
    assert all(host == "127.0.0.1" for host, _ in addresses.values())  # the default bind address

    channels = {name: grpc.insecure_channel(f"{host}:{port}") for name, (host, port) in addresses.items()}
    try:
        draft_stub = draft_pb2_grpc.DraftServiceStub(channels["specdec.draft_server"])
        target_stub = target_pb2_grpc.TargetServiceStub(channels["specdec.target_server"])
        draft_info = draft_stub.Info(common_pb2.InfoRequest(), timeout=30)
        target_info = target_stub.Info(common_pb2.InfoRequest(), timeout=30)
        assert (draft_info.dtype, draft_info.quantization) == ("bfloat16", "int4")
        assert (target_info.dtype, target_info.quantization) == ("float32", "")
        for info in (draft_info, target_info):
            assert (info.total_kv_tokens, info.max_slots, info.max_speculative_tokens) == (256, 4, 4)
        assert draft_info.tokenizer_fingerprint == target_info.tokenizer_fingerprint
        assert draft_info.vocab_size == target_info.vocab_size > 0

        check_health_and_reflection(channels["specdec.draft_server"], DRAFT_SERVICE)
        check_health_and_reflection(channels["specdec.target_server"], TARGET_SERVICE)

        # One real round through each model.
        prompt = [504, 3575, 282, 4649, 314]
        proposal = draft_stub.Propose(draft_pb2.ProposeRequest(items=[draft_pb2.ProposeItem(
            slot_id="r", new_tokens=prompt, num_speculative_tokens=3, sampling=common_pb2.SamplingParams(temperature=0),
        )]), timeout=60).results[0]
        assert len(proposal.tokens) == 3 and all(0 <= t < draft_info.vocab_size for t in proposal.tokens)
        target_stub.Prefill(target_pb2.PrefillRequest(items=[
            target_pb2.PrefillItem(slot_id="r", prompt_tokens=prompt[:-1])
        ]), timeout=60)
        verified = target_stub.Verify(target_pb2.VerifyRequest(items=[
            target_pb2.VerifyItem(slot_id="r", valid_len=len(prompt) - 1, tokens=[prompt[-1], *proposal.tokens])
        ]), timeout=60).results[0]
        assert tuple(decode_tensor(verified.logits).shape) == (4, target_info.vocab_size)
        for process in (draft, target):
            check_forward_thread_bound(process.proc.pid)
    finally:
        for channel in channels.values():
            channel.close()

    for process in (draft, target):
        process.proc.send_signal(signal.SIGTERM)
    for process in (draft, target):
        assert process.proc.wait(timeout=60) == 0, process.stderr()
        assert "signal received" in process.stderr()
