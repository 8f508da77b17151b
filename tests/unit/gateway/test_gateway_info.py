"""The gateway's Info reports the planner's status (`GatewayStats.planner`) after the last round."""

from __future__ import annotations

import asyncio
import math
from typing import cast

import grpc
import pytest

from specdec.gateway.config import GatewayConfig
from specdec.gateway.draft_sources import DraftSource
from specdec.gateway.generation import GatewayState, Generations
from specdec.gateway.info import REASON_TO_PB, SOURCE_TO_PB, STATE_TO_PB, planner_to_pb
from specdec.gateway.monitor import ServiceMonitor
from specdec.gateway.planner.status import (
    PLANNED_SOURCES,
    SOURCE_STATES,
    SWITCH_REASONS,
    PlannerStatus,
    SourceState,
    SourceStatus,
    SwitchReason,
)
from specdec.gateway.server import GatewayServicer
from specdec.v1 import common_pb2, gateway_pb2
from tests.support.fakes import FakeDraft, FakeTarget, model_info, policy, scheduler

STATUS = PlannerStatus(
    sources=(
        SourceStatus(DraftSource.MODEL, SourceState.OFF, SwitchReason.CATCH_UP, off_s=61.5, acceptance=0.42,
                     next_probe_rounds=9),
        SourceStatus(DraftSource.PROMPT_LOOKUP, SourceState.PROBING, SwitchReason.LOAD, off_s=3.0, acceptance=0.5,
                     next_probe_rounds=0),
        SourceStatus(DraftSource.SUFFIX, SourceState.DRAFTING, None, off_s=0.0, acceptance=0.9, next_probe_rounds=0),
    ),
    draft_cost_ratio=0.3, expected_speedup=1.25, off_s=0.0,
)


def test_planner_status_converts_field_by_field() -> None:
    message = planner_to_pb(STATUS)
    model, lookup, suffix = message.sources
    assert (model.source, model.state, model.reason) == (
        gateway_pb2.DRAFT_SOURCE_MODEL, gateway_pb2.DRAFT_SOURCE_STATE_OFF, gateway_pb2.SWITCH_REASON_CATCH_UP)
    assert (model.off_seconds, model.acceptance, model.next_probe_rounds) == (61.5, 0.42, 9)
    assert (lookup.state, lookup.reason) == (gateway_pb2.DRAFT_SOURCE_STATE_PROBING, gateway_pb2.SWITCH_REASON_LOAD)
    assert suffix.reason == gateway_pb2.SWITCH_REASON_UNSPECIFIED  # never switched
    assert (message.draft_cost_ratio, message.expected_speedup, message.off_seconds) == (0.3, 1.25, 0.0)


def test_default_status_has_no_sources_and_an_unknown_draft_cost() -> None:
    message = planner_to_pb(PlannerStatus())
    assert list(message.sources) == [] and math.isnan(message.draft_cost_ratio)
    assert message.expected_speedup == 1.0


@pytest.mark.parametrize(("mapping", "values", "enum", "prefix"), [
    (SOURCE_TO_PB, PLANNED_SOURCES, gateway_pb2.DraftSource, "DRAFT_SOURCE_"),
    (STATE_TO_PB, SOURCE_STATES, gateway_pb2.DraftSourceState, "DRAFT_SOURCE_STATE_"),
    (REASON_TO_PB, SWITCH_REASONS, gateway_pb2.SwitchReason, "SWITCH_REASON_"),
], ids=["source", "state", "reason"])
def test_every_value_has_a_protobuf_value_named_like_its_metric_label(
    mapping: dict[object, int], values: tuple[object, ...], enum: object, prefix: str,
) -> None:
    assert set(mapping) == set(values)
    names = {value.value: enum.Name(pb).removeprefix(prefix).lower()  # type: ignore[attr-defined]
             for value, pb in mapping.items()}
    assert all(label == name for label, name in names.items()), names


def _info(*, with_draft: bool, status: PlannerStatus | None) -> gateway_pb2.GatewayInfo:
    """Info of a gateway over fake services, its planner status set as the scheduler sets it."""
    async def main() -> gateway_pb2.GatewayInfo:
        target, draft = FakeTarget(), FakeDraft() if with_draft else None
        sched = scheduler(target, draft)
        if status is not None:
            sched.stats.planner = status
        infos = {"target": model_info(), **({"draft": model_info()} if with_draft else {})}
        clients = {"target": target, **({"draft": draft} if draft else {})}
        monitor = ServiceMonitor(clients, infos, sched.stats)  # type: ignore[arg-type]
        config = GatewayConfig(target_address="-", draft_address="-" if with_draft else "")
        state = GatewayState(config, policy(speculative=with_draft), sched, sched.stats, monitor)
        generations = Generations(state)
        try:
            servicer = GatewayServicer(state, generations)
            return await servicer.Info(common_pb2.InfoRequest(), cast(grpc.aio.ServicerContext, None))
        finally:
            generations.shutdown()

    return asyncio.run(main())


def test_info_reports_the_planner_after_the_last_round() -> None:
    info = _info(with_draft=True, status=STATUS)
    assert info.planner == planner_to_pb(STATUS)
    assert info.HasField("draft")


def test_info_of_a_gateway_without_a_draft_before_its_first_round() -> None:
    info = _info(with_draft=False, status=None)
    assert info.HasField("planner") and list(info.planner.sources) == []
    assert not info.HasField("draft") and math.isnan(info.planner.draft_cost_ratio)
