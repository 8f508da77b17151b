"""`specdec info`: the gateway's Info for people (the planner's sources as a table) and as JSON,
against a gRPC server that answers a fixed Info (no models, no services)."""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from specdec.cli.info import format_info, main, message_to_dict
from specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

PLANNER = gateway_pb2.PlannerInfo(
    sources=[
        gateway_pb2.DraftSourceStatus(
            source=gateway_pb2.DRAFT_SOURCE_MODEL, state=gateway_pb2.DRAFT_SOURCE_STATE_OFF,
            reason=gateway_pb2.SWITCH_REASON_ACCEPTANCE, off_seconds=754.25, acceptance=0.21, next_probe_rounds=9),
        gateway_pb2.DraftSourceStatus(
            source=gateway_pb2.DRAFT_SOURCE_PROMPT_LOOKUP, state=gateway_pb2.DRAFT_SOURCE_STATE_PROBING,
            reason=gateway_pb2.SWITCH_REASON_LOAD, off_seconds=30.0, acceptance=math.nan),
        gateway_pb2.DraftSourceStatus(
            source=gateway_pb2.DRAFT_SOURCE_SUFFIX, state=gateway_pb2.DRAFT_SOURCE_STATE_OFF, off_seconds=754.25,
            acceptance=0.05),
    ],
    draft_cost_ratio=0.31, expected_speedup=1.0, off_seconds=754.25,
)


def gateway_info(planner: gateway_pb2.PlannerInfo = PLANNER, *, draft: bool = True) -> gateway_pb2.GatewayInfo:
    info = gateway_pb2.GatewayInfo(
        target=common_pb2.ModelInfo(model_name="smollm2-135m", dtype="float32", device="cpu", free_kv_tokens=4096),
        target_available=True, speculative_enabled=True, default_num_speculative_tokens=4, max_speculative_tokens=8,
        adaptive_k=True, default_speculation_method=gateway_pb2.SPECULATION_METHOD_AUTO, planner=planner,
    )
    if draft:
        info.draft.CopyFrom(common_pb2.ModelInfo(model_name="smollm2-135m-int4", dtype="float32", device="cpu",
                                                 quantization="int4"))
        info.draft_available = True
    return info


def rows(text: str) -> dict[str, list[str]]:
    """The planner table's rows by source (cells split on runs of two or more spaces)."""
    lines = [line.split() for line in text.splitlines() if line.startswith("  ")]
    return {cells[0]: cells[1:] for cells in lines}


def test_text_shows_each_source_with_its_state_reason_and_estimates() -> None:
    text = format_info(gateway_info(), "gw:50050")
    assert "target       smollm2-135m (float32, cpu), available" in text
    assert "draft        smollm2-135m-int4 (float32, cpu, int4), available" in text
    assert "method auto, K 4 (at most 8), adaptive K" in text
    assert "speculation off for 754.2 s of decoding; expected speedup 1.00x, draft cost ratio 0.31" in text
    table = rows(text)
    assert table["source"] == ["state", "off", "(s)", "last", "switch", "acceptance", "next", "probe"]
    assert table["model"] == ["off", "754.2", "acceptance", "0.21", "9", "rounds"]
    assert table["prompt_lookup"] == ["probing", "30.0", "load", "-", "-"]  # no estimate: "-"
    assert table["suffix"] == ["off", "754.2", "-", "0.05", "-"]  # never switched


def test_text_of_a_gateway_without_draft_before_its_first_round() -> None:
    text = format_info(gateway_info(gateway_pb2.PlannerInfo(draft_cost_ratio=math.nan, expected_speedup=1.0),
                                    draft=False), "gw:50050")
    assert "draft        none: the gateway drafts with lookups alone" in text
    assert "planner      drafting; expected speedup 1.00x, draft cost ratio -" in text
    assert "no draft source reported yet" in text


def test_json_names_enums_like_the_metric_labels_and_unknowns_null() -> None:
    out = message_to_dict(gateway_info(draft=False))
    json.dumps(out, allow_nan=False)
    planner = out["planner"]
    assert isinstance(planner, dict)
    assert planner["sources"][0] == {"source": "model", "state": "off", "reason": "acceptance",
                                     "off_seconds": 754.25, "acceptance": 0.21, "next_probe_rounds": 9}
    assert planner["sources"][1]["acceptance"] is None and planner["sources"][2]["reason"] is None
    assert out["draft"] is None and out["default_speculation_method"] == "auto"
    assert isinstance(out["target"], dict) and out["target"]["free_kv_tokens"] == 4096


class _FixedInfo(gateway_pb2_grpc.GatewayServicer):
    def Info(self, request: common_pb2.InfoRequest, context: grpc.ServicerContext) -> gateway_pb2.GatewayInfo:
        return gateway_info()


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    gateway_pb2_grpc.add_GatewayServicer_to_server(_FixedInfo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_command_prints_the_info(address: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--gateway", address]) == 0
    assert rows(capsys.readouterr().out)["model"][:3] == ["off", "754.2", "acceptance"]


def test_command_prints_json(address: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--gateway", address, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(message_to_dict(gateway_info())))


def test_command_exits_non_zero_when_no_gateway_answers(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:  # a port nobody serves
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["--gateway", f"127.0.0.1:{port}", "--timeout", "0.5"]) == 1
    assert "error: DEADLINE_EXCEEDED" in capsys.readouterr().err
