"""What the gateway's Info reports of its planner: `PlannerStatus` as a `PlannerInfo` message.

The protobuf enums name the same values as the metrics' labels: `DRAFT_SOURCE_PROMPT_LOOKUP`
is `source="prompt_lookup"`, `SWITCH_REASON_CATCH_UP` is `reason="catch_up"`.
"""

from __future__ import annotations

from specdec.gateway.draft_sources import DraftSource
from specdec.gateway.planner.status import PlannerStatus, SourceState, SourceStatus, SwitchReason
from specdec.v1 import gateway_pb2

SOURCE_TO_PB: dict[DraftSource, gateway_pb2.DraftSource] = {
    DraftSource.MODEL: gateway_pb2.DRAFT_SOURCE_MODEL,
    DraftSource.PROMPT_LOOKUP: gateway_pb2.DRAFT_SOURCE_PROMPT_LOOKUP,
    DraftSource.SUFFIX: gateway_pb2.DRAFT_SOURCE_SUFFIX,
}
STATE_TO_PB: dict[SourceState, gateway_pb2.DraftSourceState] = {
    SourceState.DRAFTING: gateway_pb2.DRAFT_SOURCE_STATE_DRAFTING,
    SourceState.OFF: gateway_pb2.DRAFT_SOURCE_STATE_OFF,
    SourceState.PROBING: gateway_pb2.DRAFT_SOURCE_STATE_PROBING,
}
REASON_TO_PB: dict[SwitchReason, gateway_pb2.SwitchReason] = {
    SwitchReason.PAYS: gateway_pb2.SWITCH_REASON_PAYS,
    SwitchReason.COST: gateway_pb2.SWITCH_REASON_COST,
    SwitchReason.ACCEPTANCE: gateway_pb2.SWITCH_REASON_ACCEPTANCE,
    SwitchReason.LOAD: gateway_pb2.SWITCH_REASON_LOAD,
    SwitchReason.CATCH_UP: gateway_pb2.SWITCH_REASON_CATCH_UP,
    SwitchReason.DRAFT_FAILURE: gateway_pb2.SWITCH_REASON_DRAFT_FAILURE,
}


def planner_to_pb(status: PlannerStatus) -> gateway_pb2.PlannerInfo:
    return gateway_pb2.PlannerInfo(
        sources=[source_to_pb(source) for source in status.sources],
        draft_cost_ratio=status.draft_cost_ratio,
        expected_speedup=status.expected_speedup,
        off_seconds=status.off_s,
    )


def source_to_pb(status: SourceStatus) -> gateway_pb2.DraftSourceStatus:
    return gateway_pb2.DraftSourceStatus(
        source=SOURCE_TO_PB[status.source],
        state=STATE_TO_PB[status.state],
        reason=gateway_pb2.SWITCH_REASON_UNSPECIFIED if status.reason is None else REASON_TO_PB[status.reason],
        off_seconds=status.off_s,
        acceptance=status.acceptance,
        next_probe_rounds=status.next_probe_rounds,
    )
