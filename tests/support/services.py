"""Real target / draft gRPC servers on loopback, for the service tests.

The servers run in-process on one background asyncio loop (a daemon thread) and tests talk
to them through ordinary synchronous channels, so no async test plugin is needed. Engines
are built from the session's fp32 target (`target_model` in tests/conftest.py, the suite's cut of
SmolLM2): no second load. The draft uses the same fp32 model, so its greedy draft is the
model's own greedy continuation. `full_fp32_runtime` is the whole model, for tests of its text.

A plugin of tests/conftest.py: its fixtures are found by name in every test folder.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2_grpc

from specdec.cli.launcher import ServiceProcess, start_service
from specdec.draft_server.config import DraftConfig
from specdec.draft_server.engine import DraftEngine
from specdec.draft_server.server import create_server as create_draft_server
from specdec.model.llama import PagedLlama
from specdec.model.loader import LoadedModel
from specdec.model.runtime import ModelRuntime
from specdec.serving.engine import ModelEngine
from specdec.serving.grpc_server import RunningServer
from specdec.target_server.config import TargetConfig
from specdec.target_server.engine import TargetEngine
from specdec.target_server.server import create_server as create_target_server
from specdec.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc
from specdec.wire.limits import message_size_options

T = TypeVar("T")

#: Deadline of every test RPC, so a hung server fails the test instead of the session.
RPC_TIMEOUT_S = 60.0
#: Small pools: big enough for every test, cheap to allocate per test (~94 MB of fp32 KV).
SMALL_POOL: dict[str, Any] = dict(kv_token_budget=2048, block_size=16, max_slots=32, max_speculative_tokens=8,
                                  measure_costs=False, compile="off")
#: The texts of the `prompts` fixture: three lengths.
TEXTS = [
    "The capital of France is",
    "def add(a, b):\n    return",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


class LoopThread:
    """An asyncio event loop running forever on a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="grpc-test-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = RPC_TIMEOUT_S) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


@dataclass
class Service:
    """A running server, the engine behind it and a client channel to it."""

    engine: ModelEngine
    running: RunningServer
    channel: grpc.Channel
    stub: Any  # TargetServiceStub or DraftServiceStub
    health: health_pb2_grpc.HealthStub

    @property
    def port(self) -> int:
        return self.running.port

    def info(self) -> common_pb2.ModelInfo:
        return self.stub.Info(common_pb2.InfoRequest())


#: `start_target(**config_overrides)` / `start_draft(**config_overrides)`: a running service.
StartService = Callable[..., Service]


def _client_channel(port: int) -> grpc.Channel:
    """A loopback channel with the services' message limit and a default deadline per call."""
    # Like any client of these services, lift gRPC's 4 MB default receive limit: a verify
    # reply of three requests at K = 8 is already 27 x 49,152 fp32 logits (5.3 MB).
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=message_size_options())
    return grpc.intercept_channel(channel, _TimeoutInterceptor())


class _TimeoutInterceptor(grpc.UnaryUnaryClientInterceptor):
    """Give every unary call a deadline unless it sets its own."""

    def intercept_unary_unary(
        self, continuation: Callable[[grpc.ClientCallDetails, Any], Any], client_call_details: grpc.ClientCallDetails,
        request: Any,
    ) -> Any:
        if client_call_details.timeout is None:
            client_call_details = _WithDeadline(client_call_details, RPC_TIMEOUT_S)
        return continuation(client_call_details, request)


class _WithDeadline(grpc.ClientCallDetails):
    """`details` of a call, with `timeout` as its deadline."""

    def __init__(self, details: grpc.ClientCallDetails, timeout: float) -> None:
        self.method = details.method
        self.timeout = timeout
        self.metadata = details.metadata
        self.credentials = details.credentials
        self.wait_for_ready = details.wait_for_ready
        self.compression = getattr(details, "compression", None)


def target_server(runtime: ModelRuntime, **fields: Any) -> tuple[TargetEngine, Coroutine[Any, Any, RunningServer]]:
    """A target engine over `runtime` and the coroutine that starts its server on a free port."""
    config = TargetConfig(port=0, **fields)
    engine = TargetEngine(runtime, config)
    return engine, create_target_server(config, engine)


def draft_server(runtime: ModelRuntime, **fields: Any) -> tuple[DraftEngine, Coroutine[Any, Any, RunningServer]]:
    """A draft engine over `runtime` (its dtype and quantization) and the coroutine that starts its server."""
    dtype = str(runtime.dtype).removeprefix("torch.")
    config = DraftConfig(port=0, **{"dtype": dtype, "quantization": runtime.quantization, **fields})
    engine = DraftEngine(runtime, config)
    return engine, create_draft_server(config, engine)


def _service_factory(
    loop: LoopThread,
    make: Callable[..., tuple[ModelEngine, Coroutine[Any, Any, RunningServer]]],
    default_runtime: ModelRuntime,
    stub_cls: type,
) -> Iterator[StartService]:
    started: list[Service] = []

    def start(runtime: ModelRuntime | None = None, **overrides: Any) -> Service:
        engine, coro = make(runtime or default_runtime, **{**SMALL_POOL, **overrides})
        running = loop.run(coro)
        channel = _client_channel(running.port)
        service = Service(engine, running, channel, stub_cls(channel), health_pb2_grpc.HealthStub(channel))
        started.append(service)
        return service

    yield start
    for service in started:
        service.channel.close()
        loop.run(service.running.stop(grace=1.0))


@pytest.fixture(scope="session")
def service_loop() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def fp32_runtime(target_model: LoadedModel) -> ModelRuntime:
    """The suite's fp32 target wrapped for the engines (the forward holds no state)."""
    return ModelRuntime(loaded=target_model, model=PagedLlama(target_model.model), quantization="none")


@pytest.fixture(scope="session")
def full_fp32_runtime(smollm2: LoadedModel) -> ModelRuntime:
    """The whole fp32 SmolLM2 wrapped for the engines."""
    return ModelRuntime(loaded=smollm2, model=PagedLlama(smollm2.model), quantization="none")


@pytest.fixture
def start_target(service_loop: LoopThread, fp32_runtime: ModelRuntime) -> Iterator[StartService]:
    """`start_target(runtime=None, **config_overrides)` -> a running target server on `runtime`,
    by default the suite's fp32 target (stopped at teardown)."""
    yield from _service_factory(service_loop, target_server, fp32_runtime, target_pb2_grpc.TargetServiceStub)


@pytest.fixture
def start_draft(service_loop: LoopThread, fp32_runtime: ModelRuntime) -> Iterator[StartService]:
    """`start_draft(runtime=None, **config_overrides)` -> a running draft server on `runtime`, by
    default the suite's fp32 target (stopped at teardown)."""
    yield from _service_factory(service_loop, draft_server, fp32_runtime, draft_pb2_grpc.DraftServiceStub)


class StartGateway(Protocol):
    """`start_gateway(target, draft, *flags)` -> a gateway child process on those services, with
    an HTTP port and a 120-s drain (flags after these win), ready; stopped at teardown."""

    def __call__(self, target: Service, draft: Service, *flags: str) -> ServiceProcess: ...


@pytest.fixture
def start_gateway() -> Iterator[StartGateway]:
    """Gateways as child processes, so that a test can send them real signals."""
    started: list[ServiceProcess] = []

    def start(target: Service, draft: Service, *flags: str) -> ServiceProcess:
        process = start_service("specdec.gateway", [
            "--target", f"127.0.0.1:{target.port}", "--draft", f"127.0.0.1:{draft.port}", "--http-port", "0",
            "--drain-timeout-s", "120", "--log-level", "WARNING", *flags,
        ])
        started.append(process)
        return process.wait_ready(timeout=300)

    yield start
    for process in started:
        process.stop(grace=2.0)


@pytest.fixture
def target(start_target: StartService) -> Service:
    return start_target()


@pytest.fixture
def draft(start_draft: StartService) -> Service:
    return start_draft()


@pytest.fixture(scope="module")
def prompts(target_model: LoadedModel) -> list[list[int]]:
    """Three prompts of different lengths."""
    tokens = [target_model.tokenizer.encode(text) for text in TEXTS]
    assert len({len(t) for t in tokens}) == len(tokens)
    return tokens


# -- references and helpers ---------------------------------------------------------------


def reference_logits(loaded: LoadedModel, tokens: list[int]) -> torch.Tensor:
    """`transformers`' own forward over the whole sequence: fp32 logits [len(tokens), vocab]."""
    with torch.inference_mode():
        return loaded.model(torch.tensor([tokens])).logits[0].float()


def greedy_continuation(loaded: LoadedModel, tokens: list[int], n: int) -> list[int]:
    """The model's own greedy (argmax) continuation of `tokens`, `n` tokens long.

    `transformers`' forward with its own KV cache: one prefill, then one token per step.
    """
    out: list[int] = []
    with torch.inference_mode():
        step = loaded.model(torch.tensor([tokens]), use_cache=True)
        for _ in range(n):
            out.append(int(step.logits[0, -1].argmax()))
            step = loaded.model(torch.tensor([out[-1:]]), past_key_values=step.past_key_values, use_cache=True)
    return out


def eventually(condition: Callable[[], object], timeout: float = 60.0) -> bool:
    """Whether `condition()` held within `timeout` seconds, polled every 50 ms.

    For state that a service reaches in the background (a slot expired, a monitor's poll): the
    timeout is generous, so a loaded machine only takes longer, and a fast one returns at once."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def slow_down(monkeypatch: pytest.MonkeyPatch, owner: object, method: str, seconds: float) -> None:
    """Every call of `owner.method` (an engine's `verify`, `prefill` or `propose_together`: what
    the servicers call) first sleeps `seconds`, on the service's model worker as a slower
    machine would; restored after the test.

    For a test that needs a request still running at some point (a deadline passing, a cancel,
    a service killed mid-stream): a fixed cost per call makes that hold on any hardware, where
    a long request alone finishes first on a fast machine."""
    real = getattr(owner, method)

    def slowed(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, method, slowed)


def slow_first(monkeypatch: pytest.MonkeyPatch, owner: object, method: str, seconds: float, calls: int) -> None:
    """The first `calls` calls of `owner.method` sleep `seconds` first (as a service's first
    steps do while it loads compiled graphs beside them); the later ones run as they are."""
    real, made = getattr(owner, method), [0]

    def slowed(*args: Any, **kwargs: Any) -> Any:
        made[0] += 1
        if made[0] <= calls:
            time.sleep(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, method, slowed)


def rpc_error(call: Callable[[Any], Any], request: Any) -> grpc.RpcError:
    """The RpcError `call(request)` raises (fails the test if it succeeds)."""
    with pytest.raises(grpc.RpcError) as info:
        call(request)
    return info.value
