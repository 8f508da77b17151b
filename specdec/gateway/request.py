"""One request's state inside the gateway: tokens, cache bookkeeping, stop rules, stats, and
the narrow interface its stream leaves through (`StreamEvents`)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdec.gateway.detokenizer import StopStringDetokenizer
from specdec.gateway.draft_sources import DraftSource, SpeculationMethod
from specdec.grammar import RequestGrammar
from specdec.sampling.logprobs import LogprobsRequest, TokenLogprob
from specdec.sampling.params import SamplingParams


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


class Verification(enum.Enum):
    """How a sampled request's draft tokens are judged (a greedy one keeps those equal to the
    target's argmax either way)."""

    #: Speculative sampling: keep t with probability min(1, p(t) / q(t)), else draw from the
    #: residual. Keeps the most draft tokens; the output has plain decoding's distribution.
    REJECTION = "rejection"
    #: Keep t while it equals the target's own draw at its position (`DrawnMode`): the output is
    #: the tokens plain decoding draws, so a seeded request's tokens depend on its seed alone,
    #: not on K, the method or what was drafted. Keeps fewer of a model draft's tokens.
    DRAWN = "drawn"


@dataclass
class Delta:
    """What one round adds to the stream."""

    tokens: list[int]
    text: str
    #: One per token when the request asked for logprobs, else empty.
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Finished:
    """The last event of a stream."""

    reason: FinishReason
    error: str = ""
    #: Name of the `grpc.StatusCode` member a failed stream ends with (as
    #: `SpecdecError.status_code_name`): the front maps it, so scheduler state holds no gRPC type.
    status: str = "INTERNAL"


class StreamEvents(Protocol):
    """Where a request's stream goes: the front serving it (`generation.Generation`) implements
    this. The rule: the scheduler reports through these two calls and never holds a queue or a
    status, so its state is plain data a test can drive without an event loop."""

    def delta(self, delta: Delta) -> None:
        """Tokens and text a round (or the prefill) emitted."""

    def finished(self, finished: Finished) -> None:
        """The end of the stream (once per `Request.finish`)."""


@dataclass
class SpeculationCounts:
    rounds: int = 0  # rounds with K >= 1
    draft_tokens: int = 0
    accepted_tokens: int = 0
    plain_rounds: int = 0  # rounds with K = 0
    #: The share of the above whose draft tokens came from a lookup (no draft model).
    lookup_rounds: int = 0
    lookup_draft_tokens: int = 0
    lookup_accepted_tokens: int = 0
    #: Model-drafted rounds a lookup guided (the gateway's guess, or the draft's own that saved a
    #: step), and the draft tokens the guesses gave.
    guided_rounds: int = 0
    guessed_tokens: int = 0
    #: Draft tokens the grammar forced (`SpeculationStats.num_forced_tokens`).
    forced_tokens: int = 0
    #: Plain rounds since the request last drafted.
    plain_streak: int = 0

    def record(self, k: int, num_accepted: int, source: DraftSource | None = None, guessed: int = 0,
               forced: int = 0) -> None:
        if k == 0:
            self.plain_rounds += 1
            self.plain_streak += 1
            return
        self.rounds += 1
        self.plain_streak = 0
        self.draft_tokens += k
        self.accepted_tokens += num_accepted
        self.forced_tokens += forced
        if source is not None and source.is_lookup:
            self.lookup_rounds += 1
            self.lookup_draft_tokens += k
            self.lookup_accepted_tokens += num_accepted
        if source is DraftSource.LOOKUP_THEN_MODEL:
            self.guided_rounds += 1
            self.guessed_tokens += guessed

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens: the same quantity as the PromQL rate over the
        spec_decode counters, for this one request."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per speculative round (accepted + the recovered/bonus token)."""
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0


#: Where a round's wall time goes: compute inside the draft and the target, RPC transport
#: plus (de)serialisation and queueing (the calls' wall time minus that compute), the
#: gateway's acceptance step, and the rest (scheduling, emitting, Python overhead).
ROUND_PHASES = ("draft_compute", "verify_compute", "rpc", "accept", "other")


@dataclass
class RoundAnatomy:
    """Seconds per phase summed over the rounds a request took part in (see ROUND_PHASES)."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ROUND_PHASES, 0.0))

    def add(self, phases: dict[str, float]) -> None:
        for name, value in phases.items():
            self.seconds[name] += value


@dataclass(eq=False)
class Request:
    """A request being served. Owned by the scheduler task; it streams through `events`.

    Compared by identity: two requests are never the same request, and the scheduler's list
    lookups (`in`, `remove`) stay cheap instead of comparing every field.
    """

    slot_id: str
    prompt: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    num_speculative_tokens: int  # K for this sequence (its upper bound when adaptive); 0 = plain decoding
    detokenizer: StopStringDetokenizer
    #: The gateway's own random stream (the acceptance uniforms of an unseeded request).
    generator: torch.Generator
    #: Sampling params sent to the draft: the same transforms; seeded with the request's position
    #: draws under DRAWN verification (each proposal shares the uniform of the target's draw there),
    #: with an independent stream under REJECTION (whose exactness needs independent draws).
    draft_sampling: SamplingParams
    #: Sampling params of the target's draws (plain rounds, sampled and drawn verifies): the
    #: same transforms with the seed of the request's position draws.
    target_sampling: SamplingParams
    #: Prompt + accepted tokens (tokens past max_new_tokens / max length are dropped).
    tokens: list[int] = field(default_factory=list)
    #: Tokens of `tokens` each service holds as valid KV entries.
    target_valid: int = 0
    draft_valid: int = 0
    #: A Propose was sent for this request, so the draft may hold a slot to release.
    has_draft_slot: bool = False
    completion_tokens: int = 0
    #: The gateway picks K in 0..num_speculative_tokens each round from measured costs and acceptance.
    adaptive: bool = False
    #: Its slots declare `max_len`, reserving their growth in pools shared with other gateways.
    reserves_growth: bool = False
    #: What the request lets the gateway draft with (the model draft, lookups or either).
    method: SpeculationMethod = SpeculationMethod.AUTO
    #: How its draft tokens are judged when it samples.
    verification: Verification = Verification.REJECTION
    #: The logprobs of each emitted token to compute (None: the request asked for none).
    logprobs: LogprobsRequest | None = None
    #: A structured-output request's grammar, at its emitted tokens (None: free text).
    grammar: RequestGrammar | None = None
    counts: SpeculationCounts = field(default_factory=SpeculationCounts)
    anatomy: RoundAnatomy = field(default_factory=RoundAnatomy)
    #: The front streaming this request (`Generation` sets itself); None: nobody listens
    #: (planner simulations and tests that read the state alone).
    events: StreamEvents | None = None
    finish_reason: FinishReason | None = None
    cancelled: bool = False
    #: Times the scheduler freed this request's slots to make room (it resumes from `tokens`).
    preemptions: int = 0
    #: When (monotonic) the target failed this request in a way a restart explains, until a
    #: Prefill puts it on the target again (`gateway.target_outage`).
    target_lost_at: float | None = None
    created_at: float = field(default_factory=time.perf_counter)
    #: Left the admission queue: both services had room and the Prefill was sent.
    admitted_at: float | None = None
    first_token_at: float | None = None
    #: When the latest tokens were streamed.
    last_token_at: float | None = None
    finished_at: float | None = None

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def draft_pending(self) -> int:
        """Tokens the draft has not cached yet: what its next Propose must feed first."""
        return len(self.tokens) - self.draft_valid

    @property
    def max_len(self) -> int:
        """The most tokens a service may hold for it: its prompt, its most new tokens and one
        round's draft tokens past them (`specdec.serving.reservations`)."""
        return len(self.prompt) + self.max_new_tokens + self.num_speculative_tokens

    @property
    def declared_len(self) -> int:
        """The `max_len` its slots declare to the services: 0 (none) unless it reserves its growth."""
        return self.max_len if self.reserves_growth else 0

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The tokens that end this request (its EOS ids): a draft token after one is never kept."""
        return tuple(sorted(self.detokenizer.eos_token_ids))

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def emit(self, new_tokens: list[int], max_seq_len: int, logprobs: list[TokenLogprob] | None = None) -> None:
        """Append accepted tokens, applying EOS, stop strings, max_new_tokens and max length;
        `logprobs` (one per new token) go out with the tokens that are emitted."""
        room = min(self.max_new_tokens - self.completion_tokens, max_seq_len - len(self.tokens))
        kept = new_tokens[: max(room, 0)]
        self.tokens.extend(kept)
        if self.grammar is not None:
            self.grammar.advance(kept, self.detokenizer.eos_token_ids)
        update = self.detokenizer.add(kept)
        self.completion_tokens += len(update.tokens)
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        if update.tokens:
            self.last_token_at = now
        text = update.text
        if update.stopped:
            self.finish_reason = FinishReason.STOP
        elif (len(kept) < len(new_tokens) or self.completion_tokens >= self.max_new_tokens
              or len(self.tokens) >= max_seq_len):
            self.finish_reason = FinishReason.LENGTH
            text += self.detokenizer.finish()
        if (update.tokens or text) and self.events is not None:
            self.events.delta(Delta(update.tokens, text, (logprobs or [])[: len(update.tokens)]))

    def preempt(self) -> None:
        """Forget both services' caches (their slots were freed): the next admission
        prefills `tokens` under a fresh slot id, so a late Release of the old one is harmless."""
        self.preemptions += 1
        self.slot_id = f"{self.slot_id.partition('#')[0]}#{self.preemptions}"
        self.target_valid = self.draft_valid = 0
        self.has_draft_slot = False

    def finish(self, reason: FinishReason, error: str = "", status: str = "INTERNAL") -> None:
        """End the stream (idempotent for the reason already set); `status` names the gRPC
        status of a failure (`Finished.status`)."""
        if self.finish_reason is None:
            self.finish_reason = reason
        self.finished_at = time.perf_counter()
        if self.events is not None:
            self.events.finished(Finished(self.finish_reason, error, status))
