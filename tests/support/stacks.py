"""Real gateway stacks on loopback: fp32 target + a draft + the gateway, all over gRPC.

Everything runs in-process on the session's background event loop (see
tests/support/services.py); clients are the public `SpecdecClient`. Two session stacks share
the suite's fp32 target, a cut of SmolLM2 (tests/support/models.py):

* `int8_stack`: the same cut as draft, int8 weights with bf16 activations;
* `weak_stack`: the first 2 layers of the whole model as draft, mostly rejected.

`full_stack` (one a module) runs the whole model, fp32 target and int8 draft, for tests of its text.

A plugin of tests/conftest.py: its fixtures are found by name in every test folder.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import pytest
import torch

from specdec.client import GenerationResult, SpecdecClient
from specdec.cost_model import ForwardCost
from specdec.draft_server.engine import DraftEngine
from specdec.gateway.config import GatewayConfig
from specdec.gateway.server import create_gateway
from specdec.model.loader import LoadedModel
from specdec.model.runtime import ModelRuntime, build_runtime
from specdec.serving.engine import ModelEngine
from specdec.serving.grpc_server import RunningServer
from specdec.target_server.engine import TargetEngine
from tests.support.models import suite_int8_runtime
from tests.support.services import LoopThread, draft_server, target_server

POOL: dict[str, Any] = dict(kv_token_budget=8192, block_size=16, max_slots=32, max_speculative_tokens=8,
                            measure_costs=False, compile="off")


def pinned_costs(step_s: float, token_s: float) -> tuple[ForwardCost, ...]:
    """A forward-cost table in the shape a service measures at start-up (batches 1-32, 1-9
    tokens a request), from two figures instead of a timing of this machine: `step_s` for a
    one-token forward of one request, `token_s` for each further token; each further request in
    a batch adds half a step. A test that needs costs (adaptive K) gets the same ones everywhere."""
    return tuple(
        ForwardCost(batch, tokens, step_s * (1 + 0.5 * (batch - 1)) + token_s * (tokens - 1) * batch)
        for batch in (1, 2, 4, 8, 16, 32) for tokens in range(1, 10)
    )


#: Pinned costs of the fp32 target and of a draft at a quarter of its cost (about what the
#: 2-layer copy costs beside the 30-layer target: the output head dominates both).
TARGET_COSTS = pinned_costs(step_s=0.040, token_s=0.002)
DRAFT_COSTS = pinned_costs(step_s=0.010, token_s=0.0005)


@dataclass
class Stack:
    """A running trio and handles to inspect it."""

    target: TargetEngine
    draft: DraftEngine | None
    gateway: RunningServer
    #: The target's server, then the draft's if any.
    servers: list[RunningServer] = field(default_factory=list)
    #: Gateways beside `gateway` on the same target and draft (`StartStack.add_gateway`).
    more_gateways: list[RunningServer] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    def client(self, timeout: float = 120.0) -> SpecdecClient:
        return SpecdecClient(self.address, timeout=timeout)

    def engines(self) -> list[ModelEngine]:
        return [e for e in (self.target, self.draft) if e is not None]

    def wait_until_idle(self, timeout: float = 60.0) -> None:
        """Block until neither service holds a slot (every request released), or fail."""
        deadline = time.monotonic() + timeout
        while any(engine.tokens for engine in self.engines()):
            if time.monotonic() > deadline:
                held = {type(e).__name__: list(e.tokens) for e in self.engines()}
                raise AssertionError(f"slots still held after {timeout} s: {held}")
            time.sleep(0.05)


class StartStack(Protocol):
    """`start_stack(draft_runtime | None, target=dict(...), draft=dict(...), **gateway_overrides)` -> a running
    Stack (`target_runtime=` serves another target model than the session's fp32 one; `target_costs=` /
    `draft_costs=` are the forward costs the services advertise instead of none, never timed here)."""

    def __call__(self, draft_runtime: ModelRuntime | None, *, target: dict[str, Any] | None = None,
                 draft: dict[str, Any] | None = None, target_runtime: ModelRuntime | None = None,
                 target_costs: Sequence[ForwardCost] = (), draft_costs: Sequence[ForwardCost] = (),
                 **gateway: Any) -> Stack: ...

    def stop(self, stack: Stack) -> None:
        """Stop a stack now and let its memory go (a test whose stack no later test shares)."""

    def add_gateway(self, stack: Stack, **gateway: Any) -> RunningServer:
        """Another gateway on `stack`'s target and draft (stopped with the stack, before them)."""


#: `hf_greedy(prompt_ids, n)`: the target's greedy continuation by transformers.
HfGreedy = Callable[[list[int], int], list[int]]


def chat(text: str) -> list[dict[str, str]]:
    """A one-message conversation: the user says `text`."""
    return [{"role": "user", "content": text}]


def generate_all(stack: Stack, prompts: list[str], max_new_tokens: int, **options: Any) -> list[GenerationResult]:
    """Every prompt as a chat through `stack`'s gateway, all at once; results in prompt order."""
    with stack.client() as client, ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(client.generate, chat(p), max_new_tokens=max_new_tokens, **options) for p in prompts]
        return [f.result() for f in futures]


@pytest.fixture(scope="session")
def int8_runtime() -> ModelRuntime:
    return suite_int8_runtime()


@pytest.fixture(scope="session")
def weak_runtime() -> ModelRuntime:
    return build_runtime("smollm2-135m", dtype="float32", num_layers=2)


@pytest.fixture(scope="session")
def session_stacks(service_loop: LoopThread, fp32_runtime: ModelRuntime) -> Iterator[StartStack]:
    """Stacks that live for the whole session (the shared `int8_stack` and `weak_stack`)."""
    yield from _scoped(_StackStarter(service_loop, fp32_runtime))


@pytest.fixture(scope="module")
def start_module_stack(service_loop: LoopThread, fp32_runtime: ModelRuntime) -> Iterator[StartStack]:
    """`start_stack` for module-scoped fixtures: what it started stops when the module ends."""
    yield from _scoped(_StackStarter(service_loop, fp32_runtime))


@pytest.fixture
def start_stack(service_loop: LoopThread, fp32_runtime: ModelRuntime) -> Iterator[StartStack]:
    """Starts stacks on the session's loop; those the test did not stop stop at its teardown, so a
    worker holds no test's KV pools after it (each stack's pools are hundreds of MB)."""
    yield from _scoped(_StackStarter(service_loop, fp32_runtime))


def _scoped(starter: _StackStarter) -> Iterator[StartStack]:
    yield starter
    for stack in list(starter.stacks):
        starter.stop(stack)


class _StackStarter:
    def __init__(self, service_loop: LoopThread, fp32_runtime: ModelRuntime) -> None:
        self.service_loop, self.fp32_runtime = service_loop, fp32_runtime
        self.stacks: list[Stack] = []

    def __call__(self, draft_runtime: ModelRuntime | None, *, target: dict[str, Any] | None = None,
                 draft: dict[str, Any] | None = None, target_runtime: ModelRuntime | None = None,
                 target_costs: Sequence[ForwardCost] = (), draft_costs: Sequence[ForwardCost] = (),
                 **gateway: Any) -> Stack:
        service_loop = self.service_loop
        target_engine, target_start = target_server(target_runtime or self.fp32_runtime, **{**POOL, **(target or {})})
        target_engine.forward_costs = tuple(target_costs) or target_engine.forward_costs  # before Info is served
        servers = [service_loop.run(target_start)]
        draft_engine = None
        if draft_runtime is not None:
            draft_engine, draft_start = draft_server(draft_runtime, **{**POOL, **(draft or {})})
            draft_engine.forward_costs = tuple(draft_costs) or draft_engine.forward_costs
            servers.append(service_loop.run(draft_start))
        gateway_server = service_loop.run(create_gateway(_gateway_config(servers, gateway)))
        stack = Stack(target_engine, draft_engine, gateway_server, servers)
        self.stacks.append(stack)
        return stack

    def add_gateway(self, stack: Stack, **gateway: Any) -> RunningServer:
        server = self.service_loop.run(create_gateway(_gateway_config(stack.servers, gateway)))
        stack.more_gateways.append(server)
        return server

    def stop(self, stack: Stack) -> None:
        for server in [*stack.more_gateways, stack.gateway, *stack.servers]:
            self.service_loop.run(server.stop(grace=1.0))
        self.stacks.remove(stack)
        gc.collect()


def _gateway_config(services: list[RunningServer], gateway: dict[str, Any]) -> GatewayConfig:
    """A gateway on `services` (the target's server, then the draft's if any) with `gateway`'s options."""
    has_draft = len(services) > 1
    return GatewayConfig(**{
        "target_address": f"127.0.0.1:{services[0].port}",
        "draft_address": f"127.0.0.1:{services[1].port}" if has_draft else "",
        "port": 0,
        # A fixed K by default, so tests exercise batched rounds at every batch size and the
        # reject path of the weak draft; the adaptive planner has tests of its own. With a
        # draft, requests draft with it unless they ask for lookups (tests of their own).
        "speculative": has_draft, "adaptive_k": False, "speculation_method": "model" if has_draft else "auto",
        **gateway,
    })


@pytest.fixture(scope="session")
def int8_stack(session_stacks: StartStack, int8_runtime: ModelRuntime) -> Stack:
    return session_stacks(int8_runtime)


@pytest.fixture(scope="session")
def weak_stack(session_stacks: StartStack, weak_runtime: ModelRuntime) -> Stack:
    return session_stacks(weak_runtime)


@pytest.fixture(scope="session")
def full_int8_runtime() -> ModelRuntime:
    """The whole SmolLM2 with int8 weights and bf16 activations (quantized once a worker)."""
    return build_runtime("smollm2-135m", dtype="bfloat16", quantization="int8")


@pytest.fixture(scope="module")
def full_stack(
    start_module_stack: StartStack, full_fp32_runtime: ModelRuntime, full_int8_runtime: ModelRuntime
) -> Stack:
    """The whole SmolLM2: fp32 target, int8 draft (bf16 activations); for tests of its text."""
    return start_module_stack(full_int8_runtime, target_runtime=full_fp32_runtime)


def hf_greedy_of(loaded: LoadedModel) -> HfGreedy:
    """`generate(prompt_ids, n)`: transformers generate(do_sample=False) on `loaded`, EOS stripped
    (the gateway never emits EOS)."""

    def generate(prompt: list[int], max_new_tokens: int) -> list[int]:
        with torch.inference_mode():
            out = loaded.model.generate(
                torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                pad_token_id=loaded.tokenizer.eos_token_id,
            )
        generated = out[0, len(prompt):].tolist()
        eos = loaded.tokenizer.eos_token_id
        return generated[: generated.index(eos)] if eos in generated else generated

    return generate


@pytest.fixture(scope="session")
def hf_greedy(target_model: LoadedModel) -> HfGreedy:
    """`hf_greedy(prompt_ids, n)`: `hf_greedy_of` the suite's target."""
    return hf_greedy_of(target_model)
