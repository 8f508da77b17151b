"""A random Llama-3.2-1B (its first layer) served end to end: each service builds it from its
config's name, both hold the same weights, the gateway renders chats with the Llama 3 format
and greedy speculative output equals plain output."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from specdec.client import SpecdecClient
from specdec.draft_server.config import DraftConfig
from specdec.draft_server.engine import DraftEngine
from specdec.draft_server.server import create_server as create_draft_server
from specdec.gateway.config import GatewayConfig
from specdec.gateway.server import create_gateway
from specdec.serving.grpc_server import RunningServer
from specdec.serving.model_service import build_engine
from specdec.target_server.config import TargetConfig
from specdec.target_server.engine import TargetEngine
from specdec.target_server.server import create_server as create_target_server
from specdec.tuning import startup
from specdec.wire.model_info import ModelInfo
from tests.support.services import LoopThread
from tests.support.stacks import chat

MODEL = "random:llama-3.2-1b:seed=3"
#: One layer, a small pool, nothing timed or cached at start-up: cheap and the same on any machine.
SERVICE: dict[str, Any] = dict(
    model=MODEL, num_layers=1, port=0, kv_token_budget=512, max_slots=4, max_speculative_tokens=4,
    measure_costs=False, compile="off", tuning_cache=False, tune_kernels=False,
)


@pytest.fixture(scope="module")
def engines() -> tuple[TargetEngine, DraftEngine]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(startup, "measure_dense", lambda weight: ("aten", "aten"))  # pinned, not timed
        target = build_engine(TargetEngine, TargetConfig(**SERVICE))
        # The draft in fp32 too (its `auto` on the CPU is int4): the very weights of the target.
        draft = build_engine(DraftEngine, DraftConfig(**SERVICE, dtype="float32", quantization="none"))
    return target, draft


@pytest.fixture(scope="module")
def gateway(service_loop: LoopThread, engines: tuple[TargetEngine, DraftEngine]) -> Iterator[RunningServer]:
    target, draft = engines
    servers = [service_loop.run(create_target_server(target.config, target)),
               service_loop.run(create_draft_server(draft.config, draft))]
    try:
        servers.insert(0, service_loop.run(create_gateway(GatewayConfig(
            target_address=f"127.0.0.1:{servers[0].port}", draft_address=f"127.0.0.1:{servers[1].port}", port=0,
            num_speculative_tokens=4, adaptive_k=False,
        ))))
        yield servers[0]
    finally:
        for server in servers:
            service_loop.run(server.stop(grace=1.0))


def test_two_services_build_the_same_random_weights(engines: tuple[TargetEngine, DraftEngine]) -> None:
    target, draft = (engine.runtime.loaded.model for engine in engines)
    assert len(target.model.layers) == 1
    for (name, a), (_, b) in zip(target.named_parameters(), draft.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    info = ModelInfo.from_pb(engines[0].info().to_pb())
    assert (info.model_id, info.dtype, info.quantization) == (MODEL, "float32", "")  # `auto` on the CPU
    assert {c.name: (c.value, c.reason) for c in info.tuning}["dtype"] == ("float32", "fixed")


def test_greedy_speculative_equals_plain_through_the_stack(gateway: RunningServer) -> None:
    with SpecdecClient(f"127.0.0.1:{gateway.port}", timeout=120) as client:
        speculative = client.generate(chat("Name a colour."), max_new_tokens=8)
        plain = client.generate(chat("Name a colour."), max_new_tokens=8, speculative=False)
    assert speculative.prompt_tokens == 14  # the Llama 3 chat format around 4 text tokens
    assert speculative.token_ids == plain.token_ids and plain.token_ids
    assert speculative.num_draft_tokens > 0 and speculative.num_accepted_tokens > 0
