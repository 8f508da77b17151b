"""TLS toward clients, mutual TLS between the gateway and the model services, and bearer tokens.

Certificates are made per session (tests/support/pki.py). What must hold:
* a full stack with every protection on generates the same tokens as without;
* a client without the CA (or trusting another CA) cannot reach a TLS gateway;
* a model service with mutual TLS refuses a client without a certificate;
* a missing or wrong token gets UNAUTHENTICATED on Generate and Info, and on the model
  services' rpcs when they have a token; health checks answer without one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.client import SpecdecClient
from specdec.errors import InvalidArgumentError
from specdec.model.runtime import ModelRuntime
from specdec.serving.config import ModelServiceConfig
from specdec.serving.security import bearer_metadata, channel_credentials
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from tests.support.pki import Pki
from tests.support.services import StartService
from tests.support.stacks import StartStack

PROMPT = [{"role": "user", "content": "Name three colours."}]


def _token_file(folder: Path, name: str, token: str) -> str:
    path = folder / name
    path.write_text(token + "\n")
    return str(path)


def _code(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value.code()


def test_a_fully_protected_stack_serves_only_clients_with_the_ca_and_the_token(
    start_stack: StartStack, int8_runtime: ModelRuntime, pki: Pki, tmp_path: Path
) -> None:
    service_token = _token_file(tmp_path, "service-token", "s3rvice")
    client_token = _token_file(tmp_path, "client-token", "cl1ent")
    mutual = dict(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca, auth_token_file=service_token)
    stack = start_stack(
        int8_runtime, target=mutual, draft=mutual,
        service_tls_ca=pki.ca, service_tls_cert=pki.client_cert, service_tls_key=pki.client_key,
        service_auth_token_file=service_token,
        tls_cert=pki.server_cert, tls_key=pki.server_key, auth_token_file=client_token,
    )
    with SpecdecClient(stack.address, timeout=60, tls_ca=pki.ca, token="cl1ent") as client:
        result = client.generate(PROMPT, max_new_tokens=12, num_speculative_tokens=3)
        plain = client.generate(PROMPT, max_new_tokens=12, speculative=False)
        assert result.completion_tokens == 12 and result.token_ids == plain.token_ids
        assert result.num_draft_tokens > 0  # the draft answered through mutual TLS and its token
        assert client.info().target_available
    for token in ("", "wrong"):
        with SpecdecClient(stack.address, timeout=10, tls_ca=pki.ca, token=token) as client:
            assert _code(lambda: client.generate(PROMPT, max_new_tokens=4)) == grpc.StatusCode.UNAUTHENTICATED
            assert _code(client.info) == grpc.StatusCode.UNAUTHENTICATED
    with SpecdecClient(stack.address, timeout=3, tls_ca=pki.other_ca, token="cl1ent") as client:
        # The gateway's certificate is not trusted: the handshake fails until the deadline
        # (the client waits for a ready channel).
        assert _code(client.info) in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    with grpc.insecure_channel(stack.address) as channel:  # plaintext to a TLS port
        stub = health_pb2_grpc.HealthStub(channel)
        assert _code(lambda: stub.Check(health_pb2.HealthCheckRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(stack.address, channel_credentials(pki.ca)) as channel:  # health needs no token
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stack.wait_until_idle()


def test_a_model_service_with_mutual_tls_and_a_token_refuses_everyone_else(
    start_target: StartService, pki: Pki, tmp_path: Path
) -> None:
    token = _token_file(tmp_path, "token", "t0ken")
    target = start_target(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca, auth_token_file=token)
    address = f"127.0.0.1:{target.port}"
    prefill = target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(slot_id="s", prompt_tokens=[1, 2, 3])])
    verify = target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(slot_id="s", valid_len=0, tokens=[1])])
    without_cert = grpc.secure_channel(address, channel_credentials(pki.ca))
    with without_cert:
        stub = target_pb2_grpc.TargetServiceStub(without_cert)
        assert (_code(lambda: stub.Info(common_pb2.InfoRequest(), timeout=5, metadata=bearer_metadata("t0ken")))
                == grpc.StatusCode.UNAVAILABLE)
    with grpc.secure_channel(address, channel_credentials(pki.ca, pki.client_cert, pki.client_key)) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        for metadata in ((), bearer_metadata("nope")):
            info_call = functools.partial(stub.Info, common_pb2.InfoRequest(), timeout=5, metadata=metadata)
            prefill_call = functools.partial(stub.Prefill, prefill, timeout=5, metadata=metadata)
            streamed_call = functools.partial(_answers, stub.VerifyStream, [verify], metadata)
            assert _code(info_call) == _code(prefill_call) == _code(streamed_call) == grpc.StatusCode.UNAUTHENTICATED
        assert not target.engine.tokens  # the refused Prefill allocated nothing
        info = stub.Info(common_pb2.InfoRequest(), timeout=5, metadata=bearer_metadata("t0ken"))
        assert info.vocab_size > 0
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def _answers(streamed_rpc: Callable[..., Iterator[Any]], requests: list[Any], metadata: Any) -> list[Any]:
    """Every answer of a streamed rpc to `requests`."""
    return list(streamed_rpc(iter(requests), timeout=5, metadata=metadata))


def test_incomplete_security_settings_are_refused_at_start(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="tls_cert and tls_key"):
        ModelServiceConfig(tls_cert=pki.server_cert)
    with pytest.raises(InvalidArgumentError, match="tls_client_ca"):
        ModelServiceConfig(tls_client_ca=pki.ca)
    with pytest.raises(InvalidArgumentError, match="not a readable file"):
        ModelServiceConfig(auth_token_file=str(tmp_path / "missing"))
