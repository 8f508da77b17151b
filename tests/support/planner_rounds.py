"""Planner rounds for unit tests: `round_inputs` builds a round's `RoundInputs` from the
per-request switches tests think in (adaptive or not, which sources each request allows)."""

from __future__ import annotations

from collections.abc import Collection

from specdec.gateway.draft_sources import SpeculationMethod
from specdec.gateway.planner import DraftAvailability, RoundInputs
from specdec.gateway.proposers import LookupDraft
from specdec.gateway.request import Request


def method_for(model: bool, lookup: bool) -> SpeculationMethod:
    if model:
        return SpeculationMethod.AUTO if lookup else SpeculationMethod.MODEL
    return SpeculationMethod.NGRAM if lookup else SpeculationMethod.NONE


def round_inputs(
    seqs: list[Request], caps: dict[str, int], adaptive: dict[str, bool] | None = None,
    steps: dict[str, int] | None = None, *, lookups: dict[str, LookupDraft] | None = None,
    model_allowed: Collection[str] | None = None, lookup_allowed: Collection[str] = (),
    draft: DraftAvailability = DraftAvailability.READY,
) -> RoundInputs:
    """The round of `seqs`: each request adaptive as `adaptive` says (default: as it is), the
    model draft allowed for `model_allowed` (default: all) and lookups for `lookup_allowed`
    (whose draft may also guess with its own lookups)."""
    looking_up = set(lookup_allowed)
    for s in seqs:
        if adaptive is not None:
            s.adaptive = adaptive[s.slot_id]
        s.method = method_for(model_allowed is None or s.slot_id in model_allowed, s.slot_id in looking_up)
    return RoundInputs(batch=seqs, caps=caps, plain_steps=steps or {}, lookups=lookups or {},
                       lookup_enabled=bool(looking_up), draft=draft)


def still() -> float:
    """A clock that does not move: the planner's estimates do not age between a test's rounds,
    however slowly the machine runs them."""
    return 0.0
