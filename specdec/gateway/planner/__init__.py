"""The adaptive planner: whether, how much and from which source each request drafts each
round (`Planner.plan`), learnt from every round (`Planner.observe`), explored on a bounded
schedule so that no source stays off for good, and shown as `PlannerStatus`.

One owner per concern: `core` (plan / observe), `costs` (cost tables, online scales, warm-up),
`acceptance` and `lookups` (α per source), `catch_up` (a draft that is behind), `choice` (the
rate-maximising choice), `exploration` and `sources` (states and probes), `rates` (the batch's
predicted rate), `inputs` (what the scheduler hands over), `status` (what it shows).
"""

from specdec.gateway.planner.choice import OFF_REASONS
from specdec.gateway.planner.core import Planner
from specdec.gateway.planner.inputs import LOOKUP_PLAIN_STREAK, DraftAvailability, PlannerSettings, RoundInputs
from specdec.gateway.planner.status import PlannerStatus, SourceState, SourceStatus, SwitchReason

__all__ = [
    "LOOKUP_PLAIN_STREAK", "OFF_REASONS", "DraftAvailability", "Planner", "PlannerSettings", "PlannerStatus",
    "RoundInputs", "SourceState", "SourceStatus", "SwitchReason",
]
