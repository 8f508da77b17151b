"""What the planner is given: its settings once, and each round the scheduler's facts about the
batch (`RoundInputs`), which hold no policy: what to draft, and how many steps a plain round
takes, is the planner's to decide."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from specdec.errors import InvalidArgumentError
from specdec.gateway.proposers import LookupDraft
from specdec.gateway.request import Request

#: A request that may draft by lookup decodes one token a plain round until this many plain
#: rounds in a row (docs/performance.md#plain-rounds-of-requests-that-look-up): a copy's
#: lookups match again a token or two after an edit, so a longer run means none are paying.
LOOKUP_PLAIN_STREAK = 8


class DraftAvailability(enum.Enum):
    """Whether the draft model can be called this round."""

    #: The gateway runs without a draft model.
    NONE = "none"
    READY = "ready"
    #: A Propose failed or was late, or the draft came back incompatible: until its health
    #: check passes (or a compatible Info comes), no request drafts with it.
    DOWN = "down"


@dataclass(frozen=True)
class PlannerSettings:
    """The planner's tunables; the defaults are what the gateway runs with."""

    #: Acceptance of the model draft before any of its tokens was judged.
    prior_alpha: float = 0.8
    #: EMA weights per judged draft token (a request's own α, the batch-wide one) and per round
    #: (costs and overheads); see `ModelAcceptance` and `CostEstimates`.
    request_weight: float = 0.02
    global_weight: float = 0.01
    cost_weight: float = 0.1
    #: Per-request probes (`RequestProbes`): a request kept at K = 0 by choice drafts `probe_k`
    #: tokens every `probe_every` rounds, up to `max_probe_every` while probes lose, each probe
    #: costing at most `probe_budget` of the request's remaining plain-decoding time.
    probe_every: int = 16
    max_probe_every: int = 256
    probe_budget: float = 0.05
    probe_k: int = 2
    #: Prior α of a lookup of each source and match length, and the weight of its estimate.
    lookup_prior_alpha: float = 0.5
    lookup_weight: float = 0.02

    def __post_init__(self) -> None:
        for name in ("prior_alpha", "request_weight", "global_weight", "cost_weight", "probe_budget",
                     "lookup_prior_alpha", "lookup_weight"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise InvalidArgumentError(f"planner setting {name} must be within [0, 1]")
        if not 1 <= self.probe_every <= self.max_probe_every or self.probe_k < 1:
            raise InvalidArgumentError("planner probes need 1 <= probe_every <= max_probe_every and probe_k >= 1")


@dataclass(frozen=True)
class RoundInputs:
    """One round's batch as the scheduler sees it."""

    batch: list[Request]
    #: The most draft tokens each request may take (its K within its room; 0: plain only).
    caps: dict[str, int]
    #: The most tokens a plain round may decode for each request (its room within the
    #: multi-step limit; 1 while a waiting request could join at the next round). Default 1.
    plain_steps: dict[str, int] = field(default_factory=dict)
    #: This round's lookup proposal of each request that allows lookups and has one.
    lookups: dict[str, LookupDraft] = field(default_factory=dict)
    #: Whether the gateway proposes lookups (then the requests whose method allows them may).
    lookup_enabled: bool = False
    draft: DraftAvailability = DraftAvailability.READY

    @property
    def model_allowed(self) -> set[str]:
        """The requests the draft model may draft for this round."""
        if self.draft is not DraftAvailability.READY:
            return set()
        return {s.slot_id for s in self.batch if s.method.allows_model}

    @property
    def looking_up(self) -> set[str]:
        """The requests that may draft by lookup (and let the draft guess with its own)."""
        return {s.slot_id for s in self.batch if self.lookup_enabled and s.method.allows_lookup}

    @property
    def context(self) -> float | None:
        """Mean tokens per request, which prices the round's forwards."""
        return sum(len(s.tokens) for s in self.batch) / len(self.batch) if self.batch else None
