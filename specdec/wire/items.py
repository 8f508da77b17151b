"""Domain forms of everything the model-service rpcs carry, each with `to_pb` / `from_pb`.

Requests (`PrefillItem`, `VerifyItem` with its `VerifyMode`, `ProposeItem`) and results
(`ScoredChunk` for Prefill, a `VerifiedChunk` per mode for Verify, `Proposal` for Propose);
what a service says of itself is in `specdec.wire.model_info`. The services validate and execute
these; the gateway builds the requests and reads the results. Generated protobuf classes
are touched here and nowhere else, so each servicer handler and each client call is a
conversion in, one engine call, a conversion out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.errors import InvalidArgumentError, ServiceStateError
from specdec.sampling.logprobs import MAX_TOP_LOGPROBS, LogprobsRequest, RowLogprobs
from specdec.sampling.params import SamplingParams
from specdec.sampling.sparse_probs import SparseRows
from specdec.sampling.token_masks import TokenMasks
from specdec.v1 import common_pb2, draft_pb2, target_pb2
from specdec.wire.tensor_codec import decode_tensor, encode_tensor
from specdec.wire.token_masks import token_masks_from_pb, token_masks_to_pb


def sampling_from_pb(message: common_pb2.SamplingParams) -> SamplingParams:
    """Unset top_p and repetition_penalty mean "off" (1); validation names the field."""
    return SamplingParams(
        temperature=message.temperature,
        top_k=message.top_k,
        top_p=message.top_p if message.HasField("top_p") else 1.0,
        repetition_penalty=message.repetition_penalty if message.HasField("repetition_penalty") else 1.0,
        seed=message.seed if message.HasField("seed") else None,
        min_p=message.min_p,
        logit_bias=tuple(message.logit_bias.items()),
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        penalty_start=message.penalty_start,
    )


def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        repetition_penalty=params.repetition_penalty, min_p=params.min_p, logit_bias=dict(params.logit_bias),
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        penalty_start=params.penalty_start,
    )
    if params.seed is not None:
        message.seed = params.seed
    return message


def sparse_to_pb(rows: SparseRows) -> common_pb2.SparseProbs:
    return common_pb2.SparseProbs(
        row_lengths=list(rows.lengths), token_ids=rows.token_ids.tolist(), values=encode_tensor(rows.values)
    )


def sparse_from_pb(message: common_pb2.SparseProbs) -> SparseRows:
    """The rows as sent; `SparseRows.validate` checks them against a vocabulary."""
    token_ids = torch.tensor(message.token_ids, dtype=torch.int64)
    return SparseRows(tuple(message.row_lengths), token_ids, decode_tensor(message.values).reshape(-1))


# -- requests ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Lease:
    """The gateway instance (and its incarnation) that owns the slots a call creates."""

    holder: str
    #: A later start of the same holder has a greater incarnation (compared as strings).
    incarnation: str

    def to_pb(self) -> common_pb2.Lease:
        return common_pb2.Lease(holder=self.holder, incarnation=self.incarnation)

    @classmethod
    def from_pb(cls, message: common_pb2.Lease) -> Lease | None:
        """None for an unset lease (raw clients, tests): such slots never expire."""
        if not message.holder and not message.incarnation:
            return None
        return cls(message.holder, message.incarnation)


@dataclass(frozen=True)
class PrefillItem:
    """Target Prefill: allocate `slot_id` and run its prompt."""

    slot_id: str
    prompt_tokens: list[int]
    #: The most tokens the slot will hold: reserved for it against other holders' new slots (0: none).
    max_len: int = 0

    def to_pb(self) -> target_pb2.PrefillItem:
        return target_pb2.PrefillItem(slot_id=self.slot_id, prompt_tokens=self.prompt_tokens, max_len=self.max_len)

    @classmethod
    def from_pb(cls, message: target_pb2.PrefillItem) -> PrefillItem:
        return cls(message.slot_id, list(message.prompt_tokens), message.max_len)


def logprobs_request_to_pb(request: LogprobsRequest | None) -> target_pb2.LogprobsRequest | None:
    if request is None:
        return None
    transforms = sampling_to_pb(request.transforms) if request.transforms is not None else None
    return target_pb2.LogprobsRequest(top=request.top, transforms=transforms)


def logprobs_request_from_pb(message: target_pb2.LogprobsRequest, present: bool) -> LogprobsRequest | None:
    """None when the mode's field is unset (`present` false); validation names the field."""
    if not present:
        return None
    if not 0 <= message.top <= MAX_TOP_LOGPROBS:
        raise InvalidArgumentError(f"logprobs.top: {message.top} is outside [0, {MAX_TOP_LOGPROBS}]",
                                   field="logprobs.top")
    transforms = sampling_from_pb(message.transforms) if message.HasField("transforms") else None
    return LogprobsRequest(message.top, transforms)


def row_logprobs_to_pb(rows: RowLogprobs) -> target_pb2.RowLogprobs:
    return target_pb2.RowLogprobs(
        drafted=rows.drafted, answered=rows.answered,
        top_ids=[i for row in rows.top for i, _ in row], top_logprobs=[v for row in rows.top for _, v in row],
    )


def row_logprobs_from_pb(message: target_pb2.RowLogprobs) -> RowLogprobs:
    """The rows as sent, each row's alternatives split evenly (`check_row_logprobs` checks the counts)."""
    n_rows = len(message.answered)
    n_top = len(message.top_ids) // n_rows if n_rows else 0
    pairs = list(zip(message.top_ids, message.top_logprobs))
    return RowLogprobs(list(message.drafted), list(message.answered),
                       [pairs[i * n_top : (i + 1) * n_top] for i in range(n_rows)])


@dataclass(frozen=True)
class LogitsMode:
    """Return the raw logits [K + 1, vocab]: the gateway transforms them itself."""


@dataclass(frozen=True)
class ArgmaxMode:
    """Return each row's argmax [K + 1]: a greedy request whose logits need no transform."""

    logprobs: LogprobsRequest | None = None  # None: no logprobs


@dataclass(frozen=True)
class SampledMode:
    """A sampled speculative item (K >= 1): the target returns the K + 1 candidates and
    p_i(t_i) that the gateway's acceptance needs, drawn with `sampling`'s transforms."""

    sampling: SamplingParams
    draft_probs: SparseRows  # q_1..q_K as the draft sent them
    logprobs: LogprobsRequest | None = None


@dataclass(frozen=True)
class DecodeMode:
    """Plain decoding on the target (tokens = [g]): `steps` one-token forwards, each feeding the
    token chosen last: `sampling`'s choice, or the raw argmax when None."""

    steps: int = 1
    sampling: SamplingParams | None = None
    logprobs: LogprobsRequest | None = None


@dataclass(frozen=True)
class DrawnMode:
    """A seeded sampled speculative item (K >= 1): the target returns each row's draw from p
    [K + 1], made with the generator of the row's sequence position (`position_generator`),
    the token plain decoding draws there."""

    sampling: SamplingParams
    logprobs: LogprobsRequest | None = None


#: How the target answers a Verify item; each mode is one code path on the target.
VerifyMode = LogitsMode | ArgmaxMode | SampledMode | DecodeMode | DrawnMode


def requested_logprobs(mode: VerifyMode) -> LogprobsRequest | None:
    """The logprobs an item's mode asks the target for (a Logits answer has them already)."""
    return None if isinstance(mode, LogitsMode) else mode.logprobs


def verify_mode_to_pb(mode: VerifyMode) -> target_pb2.VerifyMode:
    match mode:
        case LogitsMode():
            return target_pb2.VerifyMode(logits=target_pb2.VerifyMode.Logits())
        case ArgmaxMode(logprobs):
            return target_pb2.VerifyMode(argmax=target_pb2.VerifyMode.Argmax(logprobs=logprobs_request_to_pb(logprobs)))
        case SampledMode(sampling, draft_probs, logprobs):
            sampled = target_pb2.VerifyMode.Sampled(sampling=sampling_to_pb(sampling),
                                                    draft_probs=sparse_to_pb(draft_probs),
                                                    logprobs=logprobs_request_to_pb(logprobs))
            return target_pb2.VerifyMode(sampled=sampled)
        case DecodeMode(steps, sampling, logprobs):
            decode = target_pb2.VerifyMode.Decode(steps=steps, sampling=sampling_to_pb(sampling) if sampling else None,
                                                  logprobs=logprobs_request_to_pb(logprobs))
            return target_pb2.VerifyMode(decode=decode)
        case DrawnMode(sampling, logprobs):
            drawn = target_pb2.VerifyMode.Drawn(sampling=sampling_to_pb(sampling),
                                                logprobs=logprobs_request_to_pb(logprobs))
            return target_pb2.VerifyMode(drawn=drawn)


def verify_mode_from_pb(message: target_pb2.VerifyMode) -> VerifyMode:
    match message.WhichOneof("mode"):
        case "logits" | None:
            return LogitsMode()
        case "argmax":
            argmax = message.argmax
            return ArgmaxMode(logprobs_request_from_pb(argmax.logprobs, argmax.HasField("logprobs")))
        case "sampled":
            sampled = message.sampled
            return SampledMode(sampling_from_pb(sampled.sampling), sparse_from_pb(sampled.draft_probs),
                               logprobs_request_from_pb(sampled.logprobs, sampled.HasField("logprobs")))
        case "decode":
            decode = message.decode
            sampling = sampling_from_pb(decode.sampling) if decode.HasField("sampling") else None
            return DecodeMode(decode.steps, sampling,
                              logprobs_request_from_pb(decode.logprobs, decode.HasField("logprobs")))
        case "drawn":
            drawn = message.drawn
            return DrawnMode(sampling_from_pb(drawn.sampling),
                             logprobs_request_from_pb(drawn.logprobs, drawn.HasField("logprobs")))
    raise InvalidArgumentError(f"mode: unknown Verify mode {message.WhichOneof('mode')!r}", field="mode")


@dataclass(frozen=True)
class VerifyItem:
    """Target Verify: roll back to `valid_len`, then score `tokens` = [g, t1 .. tK] and answer
    as `mode` says."""

    slot_id: str
    valid_len: int
    tokens: list[int]
    mode: VerifyMode = LogitsMode()
    #: A structured-output request's grammar masks, one per answered row (None: no grammar).
    allowed: TokenMasks | None = None

    @property
    def cached_len_after(self) -> int:
        """Tokens the slot holds after this item: valid_len + K + 1, or for a Decode item g and
        all but the last decoded token (if it took every step: it may stop early)."""
        steps = self.mode.steps if isinstance(self.mode, DecodeMode) else 1
        return self.valid_len + max(len(self.tokens), steps)

    def to_pb(self) -> target_pb2.VerifyItem:
        message = target_pb2.VerifyItem(
            slot_id=self.slot_id, valid_len=self.valid_len, tokens=self.tokens, mode=verify_mode_to_pb(self.mode)
        )
        if self.allowed is not None:
            message.allowed.CopyFrom(token_masks_to_pb(self.allowed))
        return message

    @classmethod
    def from_pb(cls, message: target_pb2.VerifyItem) -> VerifyItem:
        allowed = token_masks_from_pb(message.allowed) if message.HasField("allowed") else None
        return cls(message.slot_id, message.valid_len, list(message.tokens), verify_mode_from_pb(message.mode),
                   allowed)


@dataclass(frozen=True)
class DraftGrammar:
    """A structured-output request's grammar as the draft walks it: llguidance grammar `text`,
    read from sequence position `start` (the answer's first token) on, its forced tokens fed as
    guesses where `forced_guesses`."""

    text: str
    start: int
    forced_guesses: bool = True

    def to_pb(self) -> draft_pb2.DraftGrammar:
        return draft_pb2.DraftGrammar(text=self.text, start=self.start, forced_guesses=self.forced_guesses)

    @classmethod
    def from_pb(cls, message: draft_pb2.DraftGrammar) -> DraftGrammar:
        return cls(message.text, message.start, message.forced_guesses)


@dataclass(frozen=True)
class ProposeItem:
    """Draft Propose: roll back to `valid_len`, feed `new_tokens`, draft K tokens (checking
    `guess_tokens`, a lookup's guess at them, in the same forward), or fewer, ending at the
    first of `stop_token_ids` drawn."""

    slot_id: str
    valid_len: int
    new_tokens: list[int]
    num_speculative_tokens: int  # K
    sampling: SamplingParams
    guess_tokens: list[int] = field(default_factory=list)
    #: Guess with the draft's own prompt lookup wherever no guess is left to check.
    lookup_guesses: bool = False
    #: Tokens that end the request: no draft token after one could be kept.
    stop_token_ids: tuple[int, ...] = ()
    #: A structured-output request's grammar: every draw is masked by it.
    grammar: DraftGrammar | None = None
    #: For a slot this call creates: the most tokens it will hold, as `PrefillItem.max_len`.
    max_len: int = 0

    def to_pb(self) -> draft_pb2.ProposeItem:
        return draft_pb2.ProposeItem(
            slot_id=self.slot_id, valid_len=self.valid_len, new_tokens=self.new_tokens,
            num_speculative_tokens=self.num_speculative_tokens, sampling=sampling_to_pb(self.sampling),
            guess_tokens=self.guess_tokens, lookup_guesses=self.lookup_guesses, stop_token_ids=self.stop_token_ids,
            grammar=self.grammar.to_pb() if self.grammar is not None else None, max_len=self.max_len,
        )

    @classmethod
    def from_pb(cls, message: draft_pb2.ProposeItem) -> ProposeItem:
        return cls(
            message.slot_id, message.valid_len, list(message.new_tokens), message.num_speculative_tokens,
            sampling_from_pb(message.sampling), list(message.guess_tokens), message.lookup_guesses,
            tuple(message.stop_token_ids),
            DraftGrammar.from_pb(message.grammar) if message.HasField("grammar") else None, message.max_len,
        )


# -- results ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ScoredChunk:
    """What the target returns per request from Prefill."""

    slot_id: str
    logits: torch.Tensor  # [vocab], at the last prompt position; raw, at compute precision
    cached_len: int

    def to_pb(self) -> target_pb2.PrefillResult:
        return target_pb2.PrefillResult(slot_id=self.slot_id, logits=encode_tensor(self.logits),
                                        cached_len=self.cached_len)

    @classmethod
    def from_pb(cls, message: target_pb2.PrefillResult) -> ScoredChunk:
        return cls(message.slot_id, decode_tensor(message.logits), message.cached_len)


@dataclass(frozen=True)
class VerifiedLogits:
    """A `LogitsMode` item's answer."""

    slot_id: str
    cached_len: int
    logits: torch.Tensor  # [K + 1, vocab]; raw, at compute precision


@dataclass(frozen=True)
class VerifiedArgmax:
    """An `ArgmaxMode` item's answer."""

    slot_id: str
    cached_len: int
    tokens: list[int]  # [K + 1]
    logprobs: RowLogprobs | None = None  # [K + 1 rows] when the mode asked


@dataclass(frozen=True)
class VerifiedSampled:
    """A `SampledMode` item's answer."""

    slot_id: str
    cached_len: int
    candidates: list[int]  # [K + 1]: the token the round emits if it stops at each position
    target_probs: list[float]  # [K]: p_i(t_i)
    logprobs: RowLogprobs | None = None  # [K + 1 rows] when the mode asked


@dataclass(frozen=True)
class VerifiedDecode:
    """A `DecodeMode` item's answer."""

    slot_id: str
    cached_len: int
    tokens: list[int]  # [1..steps]
    logprobs: RowLogprobs | None = None  # a row per decoded token when the mode asked


@dataclass(frozen=True)
class VerifiedDrawn:
    """A `DrawnMode` item's answer."""

    slot_id: str
    cached_len: int
    tokens: list[int]  # [K + 1]: each row's draw from p
    logprobs: RowLogprobs | None = None  # [K + 1 rows] when the mode asked


#: What the target returns per Verify item: the answer of the item's mode.
VerifiedChunk = VerifiedLogits | VerifiedArgmax | VerifiedSampled | VerifiedDecode | VerifiedDrawn


def verified_to_pb(chunk: VerifiedChunk) -> target_pb2.VerifyResult:
    result = target_pb2.VerifyResult(slot_id=chunk.slot_id, cached_len=chunk.cached_len)
    match chunk:
        case VerifiedLogits(logits=logits):
            result.logits.CopyFrom(encode_tensor(logits))
        case VerifiedArgmax(tokens=tokens):
            result.argmax.ids.extend(tokens)
        case VerifiedSampled(candidates=candidates, target_probs=target_probs):
            result.sampled.candidates.extend(candidates)
            result.sampled.target_probs.extend(target_probs)
        case VerifiedDecode(tokens=tokens):
            result.decoded.ids.extend(tokens)
        case VerifiedDrawn(tokens=tokens):
            result.drawn.ids.extend(tokens)
    if not isinstance(chunk, VerifiedLogits) and chunk.logprobs is not None:
        result.logprobs.CopyFrom(row_logprobs_to_pb(chunk.logprobs))
    return result


def verified_from_pb(message: target_pb2.VerifyResult) -> VerifiedChunk:
    slot_id, cached_len = message.slot_id, message.cached_len
    logprobs = row_logprobs_from_pb(message.logprobs) if message.HasField("logprobs") else None
    match message.WhichOneof("answer"):
        case "logits":
            return VerifiedLogits(slot_id, cached_len, decode_tensor(message.logits))
        case "argmax":
            return VerifiedArgmax(slot_id, cached_len, list(message.argmax.ids), logprobs)
        case "sampled":
            return VerifiedSampled(slot_id, cached_len, list(message.sampled.candidates),
                                   list(message.sampled.target_probs), logprobs)
        case "decoded":
            return VerifiedDecode(slot_id, cached_len, list(message.decoded.ids), logprobs)
        case "drawn":
            return VerifiedDrawn(slot_id, cached_len, list(message.drawn.ids), logprobs)
    raise ServiceStateError(f"the target sent no answer for slot {slot_id!r}")


@dataclass(frozen=True)
class Proposal:
    """What the draft returns per request from Propose."""

    slot_id: str
    tokens: list[int]  # [k]: K, or fewer when the last is a stop token
    #: q_1..q_K in the wire dtype, exactly the rows the tokens were sampled from (before the
    #: sampler's normalization), tail cut; None for greedy requests.
    probs: SparseRows | None
    cached_len: int
    #: Draws whose logits a guessed token's forward gave: draft steps the guesses saved.
    saved_steps: int = 0
    #: Tokens of the draft's own lookup guesses it fed, each a token of width on a forward.
    own_guess_tokens: int = 0
    #: Draws a grammar's forced tokens gave (steps saved), and the forced tokens fed (width).
    forced_steps: int = 0
    forced_tokens: int = 0

    def to_pb(self) -> draft_pb2.ProposeResult:
        return draft_pb2.ProposeResult(
            slot_id=self.slot_id, tokens=self.tokens, cached_len=self.cached_len,
            probs=sparse_to_pb(self.probs) if self.probs is not None else None, saved_steps=self.saved_steps,
            own_guess_tokens=self.own_guess_tokens, forced_steps=self.forced_steps, forced_tokens=self.forced_tokens,
        )

    @classmethod
    def from_pb(cls, message: draft_pb2.ProposeResult) -> Proposal:
        probs = sparse_from_pb(message.probs) if message.HasField("probs") else None
        return cls(message.slot_id, list(message.tokens), probs, message.cached_len, message.saved_steps,
                   message.own_guess_tokens, message.forced_steps, message.forced_tokens)
