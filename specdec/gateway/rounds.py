"""What a round is planned to do (`RoundPlan`, from the K planner) and what it did
(`RoundReport`, back to the planner and the statistics)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from specdec.gateway.draft_sources import DraftSource
from specdec.gateway.model_clients import Timed
from specdec.gateway.proposers import LookupDraft


class ProposeOutcome(enum.Enum):
    """How a round's Propose went."""

    #: Answered, or not needed.
    ANSWERED = "answered"
    #: Failed or missed its deadline: the round decoded plainly and the draft is suspect.
    FAILED = "failed"
    #: Refused for room (a draft pool shared with other gateways): the round decoded plainly,
    #: and the draft is fine (`specdec.gateway.pools`).
    NO_ROOM = "no_room"


@dataclass(frozen=True)
class RoundPlan:
    """One round of a batch, per request (by slot id)."""

    #: Draft tokens K per request; 0 decodes that request plainly this round.
    ks: dict[str, int]
    #: Tokens the target decodes by itself per request in a plain round (multi-step), each
    #: feeding the one it chose last; empty in a round that drafts (its plain requests take 1).
    steps: dict[str, int] = field(default_factory=dict)
    #: Tokens each request feeds the draft before drafting (1, or 2 after a fully accepted round).
    feeds: dict[str, int] = field(default_factory=dict)
    #: Mean cached tokens per request, which prices the round's forwards (None: unknown).
    context: float | None = None
    #: Some request feeds the draft more than a round's tokens (a catch-up): the round's
    #: Propose time says little about a draft step's cost.
    catching_up: bool = False
    #: Why a request that could have drafted did not (one of `OFF_REASONS`), if one did not.
    off_reason: str | None = None
    #: The requests whose K tokens a lookup proposed (exactly K of them): the draft model
    #: drafts for the others with K >= 1.
    lookups: dict[str, LookupDraft] = field(default_factory=dict)
    #: Lookup proposals the round does not verify, with the request's length when they were
    #: made: the planner judges them against the tokens the round emits instead.
    offered: dict[str, tuple[int, LookupDraft]] = field(default_factory=dict)
    #: Requests the draft model drafts for with a lookup's tokens as its guess, cut to the
    #: tokens worth feeding (`ProposeItem.guess_tokens`).
    guesses: dict[str, LookupDraft] = field(default_factory=dict)
    #: Requests the draft model drafts for that let it guess with its own lookup
    #: (`ProposeItem.lookup_guesses`).
    self_guessing: set[str] = field(default_factory=set)
    #: Seconds the round's catch-ups take by the draft's cost table as measured, and of them
    #: the part past the table's widest measured chunk: the planner's catch-up correction
    #: compares the Propose's time with them.
    catch_up_s: float = 0.0
    catch_up_beyond_s: float = 0.0
    #: Tokens of the round's longest catch-up (its length class gets the correction).
    catch_up_tokens: int = 0
    #: The tokens each catching-up request feeds its draft in the round's first forward.
    catch_up_feeds: dict[str, int] = field(default_factory=dict)
    #: For each request whose draft catch-up waits (`CatchUpPricer.renting`) where a caught-up
    #: draft would have been faster: the batch's tokens per second then. The round's time past
    #: its tokens at that rate is the request's rent.
    caught_up_rates: dict[str, float] = field(default_factory=dict)
    #: Requests whose draft cache the target's fills before the Propose (`CatchUpPricer.hands_off`):
    #: the draft has fallen behind by more than a round's tokens, and a copy costs less than its forward.
    handoffs: frozenset[str] = frozenset()
    #: Structured-output requests draft the tokens their grammar forces (`grammar.rounds`), and
    #: the model draft guesses them.
    grammar_drafts: bool = True

    @property
    def drafts(self) -> bool:
        return any(self.ks.values())

    @property
    def model_ks(self) -> dict[str, int]:
        """K per request that the draft model drafts (0 for plain and lookup requests)."""
        return {slot: 0 if slot in self.lookups else k for slot, k in self.ks.items()}

    def source_of(self, slot_id: str, guessed: bool = False) -> DraftSource | None:
        """Where the request's draft tokens come from this round; None when it decodes plainly.
        A model draft is guided by a lookup where the plan gave it a guess or a guess saved it
        a step (`guessed`: the draft's own may have)."""
        if not self.ks.get(slot_id):
            return None
        lookup = self.lookups.get(slot_id)
        if lookup is not None:
            return lookup.source
        guided = guessed or slot_id in self.guesses
        return DraftSource.LOOKUP_THEN_MODEL if guided else DraftSource.MODEL

    def steps_of(self, slot_id: str) -> int:
        return self.steps.get(slot_id, 1)


@dataclass(frozen=True)
class RoundReport:
    """What one round did, for statistics and the K planner: K and accepted count per slot,
    and where the round's time went."""

    ks: dict[str, int]
    num_accepted: dict[str, int]
    #: Propose and Verify: compute inside the service, wall time seen by the gateway, the
    #: room each service reported, and the forward's items and the call's wait for it.
    propose: Timed[None]
    verify: Timed[None]
    #: The gateway's acceptance step (rejection sampling / greedy matching) for the batch.
    accept_s: float
    #: The whole round, wall clock.
    total_s: float
    #: Whether Propose was answered; when not, the round ran as plain decoding.
    propose_outcome: ProposeOutcome = ProposeOutcome.ANSWERED
    #: Tokens the target decoded per slot in a plain round (1 in any other round).
    steps: dict[str, int] = field(default_factory=dict)
    #: Where each drafting slot's tokens came from (slots with K = 0 are absent).
    sources: dict[str, DraftSource] = field(default_factory=dict)
    #: Draft steps the guesses saved each model-drafted slot, as the draft counted them
    #: (`Proposal.saved_steps`; the lookup's guess and the draft's own).
    guessed: dict[str, int] = field(default_factory=dict)
    #: Tokens of the draft's own lookup guesses fed per slot (`Proposal.own_guess_tokens`).
    own_guess_tokens: dict[str, int] = field(default_factory=dict)
    #: Per model-drafted slot whose grammar forced tokens: the draft steps they saved and the
    #: tokens fed (`Proposal.forced_steps`, `forced_tokens`).
    forced: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: The round's KV handoffs (`RoundPlan.handoffs`) that succeeded: tokens moved and seconds, per slot.
    handoffs: dict[str, tuple[int, float]] = field(default_factory=dict)

    def steps_of(self, slot_id: str) -> int:
        return self.steps.get(slot_id, 1)

    @property
    def handoff_s(self) -> float:
        return sum(seconds for _, seconds in self.handoffs.values())

    @property
    def handoff_tokens(self) -> int:
        return sum(tokens for tokens, _ in self.handoffs.values())

    def emitted(self, slot_id: str) -> int:
        """Tokens the round gave the request: its accepted draft tokens and the target's own
        (one after a draft, `steps` in a plain round, which accepts none)."""
        return self.num_accepted[slot_id] + self.steps_of(slot_id)

    def phases(self) -> dict[str, float]:
        """The round's wall time split by `ROUND_PHASES`."""
        rpc = (self.propose.wall_s - self.propose.compute_s + self.verify.wall_s - self.verify.compute_s
               + self.handoff_s)  # a handoff is a copy between the services
        counted = self.propose.compute_s + self.verify.compute_s + max(0.0, rpc) + self.accept_s
        return {
            "draft_compute": self.propose.compute_s,
            "verify_compute": self.verify.compute_s,
            "rpc": max(0.0, rpc),
            "accept": self.accept_s,
            "other": max(0.0, self.total_s - counted),
        }

    @property
    def queued_s(self) -> float:
        """Seconds the round's calls waited at the services for their forwards to begin."""
        return self.propose.queued_s + self.verify.queued_s

    @property
    def overhead_s(self) -> float:
        """Round time spent outside both services' compute: RPCs, (de)serialisation, acceptance.
        Not a KV handoff's, which the planner prices on its own, nor the calls' waits at the
        services (`queued_s`): a wait to merge with another gateway's call, or behind a Prefill,
        comes of other calls, not of this round's K; learnt as the cost of drafting, it made a
        gateway that shares its services draft longer K (to spread it) and turn its draft off
        more often."""
        return max(0.0, self.total_s - self.propose.compute_s - self.verify.compute_s - self.handoff_s
                   - self.queued_s)
