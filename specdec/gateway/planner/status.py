"""What the planner shows of itself: each draft source's state, why it last switched, and the
live estimates behind its choices (metrics, the gateway's Info, `specdec info`, log lines)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from specdec.gateway.draft_sources import DraftSource

#: The sources the planner switches on and off, and explores while off. A model draft guided by
#: a lookup (`DraftSource.LOOKUP_THEN_MODEL`) is the model draft here.
PLANNED_SOURCES = (DraftSource.MODEL, DraftSource.PROMPT_LOOKUP, DraftSource.SUFFIX)


class SourceState(enum.Enum):
    """Where a draft source stands with the planner."""

    #: Some request drafts with it because the estimates say it pays.
    DRAFTING = "drafting"
    #: Requests could draft with it, but the estimates say it does not pay (or it is unavailable).
    OFF = "off"
    #: Off, and drafting this round anyway: a scheduled probe that refreshes its estimates.
    PROBING = "probing"


class SwitchReason(enum.Enum):
    """Why a source switched: back on (`PAYS`), or off and which estimate decided it."""

    PAYS = "pays"
    #: The draft's steps cost more than even a draft that is always accepted repays, at batch 1.
    COST = "cost"
    #: Its tokens are not accepted often enough to repay their cost.
    ACCEPTANCE = "acceptance"
    #: It would pay for a smaller batch: the batch's verify width costs too much.
    LOAD = "load"
    #: The draft's catch-up (a prompt it never saw) costs more than the request's rest repays.
    CATCH_UP = "catch_up"
    #: The draft service failed, is unreachable, or was refused.
    DRAFT_FAILURE = "draft_failure"


SWITCH_REASONS = tuple(SwitchReason)
SOURCE_STATES = tuple(SourceState)


@dataclass(frozen=True)
class SourceStatus:
    source: DraftSource
    state: SourceState
    #: Why the source last switched (None before its first switch).
    reason: SwitchReason | None
    #: Seconds of decoding rounds since the source last drafted on its merits (0 while it does);
    #: probes do not reset it, idle time does not add to it.
    off_s: float
    #: The planner's acceptance estimate for it (the model draft's over all requests; a lookup's
    #: for its shortest matches).
    acceptance: float
    #: Rounds with a candidate for it until its next probe, while it is off (0 otherwise).
    next_probe_rounds: int


@dataclass(frozen=True)
class PlannerStatus:
    sources: tuple[SourceStatus, ...] = ()
    #: The draft's 1-token step ÷ the target's, at batch 1, as the planner prices them now
    #: (NaN without a draft model or its costs).
    draft_cost_ratio: float = math.nan
    #: The last planned round's expected tokens per second ÷ a plain round's (1.0 when plain).
    expected_speedup: float = 1.0
    #: Seconds of decoding rounds since any source last drafted on its merits.
    off_s: float = 0.0
    #: Switches so far, by source and reason.
    switches: dict[tuple[DraftSource, SwitchReason], int] = field(default_factory=dict)
    #: Rows of each service's forwards per row of this gateway's calls, as rounds are priced
    #: (`specdec.gateway.planner.costs.ForwardRows`; 1: the forwards are its own).
    forward_rows: dict[str, float] = field(default_factory=dict)

    def of(self, source: DraftSource) -> SourceStatus | None:
        return next((s for s in self.sources if s.source is source), None)
