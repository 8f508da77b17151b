"""The public API at the gateway's edge: a validated `Request` from a `GenerateRequest`,
and the final `Completion` message from a finished `Request`.

Everything a client can get wrong is checked here, before the request reaches the
scheduler, and answered with INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from specdec.errors import InvalidArgumentError
from specdec.gateway.detokenizer import StopStringDetokenizer
from specdec.gateway.draft_sources import SpeculationMethod
from specdec.gateway.grammar import grammar_text, structured_output_from_pb
from specdec.gateway.request import FinishReason, Request, Verification
from specdec.grammar import GrammarCompiler, RequestGrammar
from specdec.model.chat import encode_chat
from specdec.sampling.draws import make_generator
from specdec.sampling.logprobs import LogprobsOptions, TokenLogprob
from specdec.sampling.params import SamplingParams, independent_seed
from specdec.v1 import gateway_pb2
from specdec.wire.items import sampling_from_pb

#: The random stream of a request's position draws (`independent_seed`; each sequence position
#: then gets its own generator, `position_generator`): the token plain decoding draws at a
#: position, made by the target, and a first token; under DRAWN verification also the draft's
#: proposal for it. Under REJECTION the draft draws from its own stream, and the gateway's
#: acceptance uniforms come from the request's seed itself.
DRAFT_STREAM = 1
POSITION_STREAM = 2
#: Roles the chat templates of the supported models render (`ipython`: Llama 3's tool results).
CHAT_ROLES = ("system", "user", "assistant", "tool", "ipython")
#: Stop strings are matched against the text of every round: bound their number and size.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
#: The request's method by its protobuf value; None: the gateway's default.
METHOD_FROM_PB: dict[gateway_pb2.SpeculationMethod, SpeculationMethod | None] = {
    gateway_pb2.SPECULATION_METHOD_UNSPECIFIED: None,
    gateway_pb2.SPECULATION_METHOD_AUTO: SpeculationMethod.AUTO,
    gateway_pb2.SPECULATION_METHOD_MODEL: SpeculationMethod.MODEL,
    gateway_pb2.SPECULATION_METHOD_NGRAM: SpeculationMethod.NGRAM,
    gateway_pb2.SPECULATION_METHOD_NONE: SpeculationMethod.NONE,
}
VERIFICATION_FROM_PB: dict[gateway_pb2.Verification, Verification | None] = {
    gateway_pb2.VERIFICATION_UNSPECIFIED: None,
    gateway_pb2.VERIFICATION_REJECTION: Verification.REJECTION,
    gateway_pb2.VERIFICATION_DRAWN: Verification.DRAWN,
}
_FINISH_TO_PB = {
    FinishReason.STOP: gateway_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: gateway_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: gateway_pb2.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: gateway_pb2.FINISH_REASON_ERROR,
}


@dataclass(frozen=True)
class RequestPolicy:
    """What a request may ask for and what it gets when it asks nothing (fixed at start-up)."""

    tokenizer: PreTrainedTokenizerBase
    vocab_size: int
    eos_token_ids: frozenset[int]
    #: The smaller of the two services' limits.
    max_seq_len: int
    max_speculative_tokens: int
    has_draft: bool
    speculative: bool
    num_speculative_tokens: int
    adaptive_k: bool
    default_max_new_tokens: int
    #: Its requests' slots declare their whole length (`Request.reserves_growth`).
    reserve_kv_growth: bool = False
    #: Every slot id starts with it: this gateway's instance name and incarnation, so gateways
    #: sharing a service never clash and an operator can tell whose slots a service holds.
    slot_prefix: str = ""
    #: The method of a speculating request that names none.
    default_method: SpeculationMethod = SpeculationMethod.AUTO
    #: Compiles structured-output requests' grammars (None: such requests are refused).
    grammars: GrammarCompiler | None = None


def new_request(request: gateway_pb2.GenerateRequest, policy: RequestPolicy) -> Request:
    """The request as the scheduler serves it; InvalidArgumentError names the bad field."""
    which = request.WhichOneof("input")
    if which == "prompt":
        prompt = list(policy.tokenizer(request.prompt)["input_ids"])
    elif which == "chat":
        for i, message in enumerate(request.chat.messages):
            if message.role not in CHAT_ROLES:
                raise InvalidArgumentError(f"chat.messages[{i}].role: {message.role!r} is not one of "
                                           f"{', '.join(CHAT_ROLES)}", field=f"chat.messages[{i}].role")
        prompt = encode_chat(policy.tokenizer, [{"role": m.role, "content": m.content} for m in request.chat.messages])
    else:
        raise InvalidArgumentError("input: set either prompt or chat", field="input")
    check_prompt(prompt, policy.max_seq_len, policy.vocab_size)
    check_stop_strings(list(request.stop))
    if request.max_new_tokens < 0:
        raise InvalidArgumentError(f"max_new_tokens: must be >= 0, got {request.max_new_tokens}",
                                   field="max_new_tokens")
    room = policy.max_seq_len - len(prompt)
    if request.refuse_past_context and request.max_new_tokens > room:
        raise InvalidArgumentError(
            f"max_new_tokens: {request.max_new_tokens} is more than the {room} tokens the context of "
            f"{policy.max_seq_len} leaves after the prompt's {len(prompt)}", field="max_new_tokens"
        )
    # The services count presence and frequency from the output's start: the prompt's end.
    sampling = dataclasses.replace(sampling_from_pb(request.sampling), penalty_start=len(prompt))
    check_logit_bias(sampling, policy.vocab_size)
    spec = request.speculation
    method = speculation_method(spec, policy)
    verification = verification_of(spec, sampling)
    speculate = method is not SpeculationMethod.NONE
    k_given = spec.HasField("num_speculative_tokens")
    k = spec.num_speculative_tokens if k_given else policy.num_speculative_tokens
    # A request that names its K alone gets exactly that K; `adaptive` overrides either way.
    adaptive = spec.adaptive if spec.HasField("adaptive") else policy.adaptive_k and not k_given
    if speculate and not 1 <= k <= policy.max_speculative_tokens:
        raise InvalidArgumentError(
            f"speculation.num_speculative_tokens: {k} is outside [1, {policy.max_speculative_tokens}]",
            field="speculation.num_speculative_tokens"
        )
    return Request(
        slot_id=policy.slot_prefix + uuid.uuid4().hex,
        prompt=prompt,
        sampling=sampling,
        # Capped at what the sequence limit leaves (unless refused above): a request for 10**9
        # tokens is a request for as many as fit, not a claim on 10**9 tokens of anything.
        max_new_tokens=min(request.max_new_tokens or policy.default_max_new_tokens, room),
        num_speculative_tokens=k if speculate else 0,
        adaptive=adaptive,
        method=method,
        reserves_growth=policy.reserve_kv_growth,
        detokenizer=StopStringDetokenizer(policy.tokenizer, list(request.stop), set(policy.eos_token_ids)),
        generator=make_generator(sampling.seed, "cpu"),
        # Under DRAWN the draft proposes position j with the uniform the target draws j with: a
        # draft token is kept when it equals that draw, which the shared uniform makes likely.
        draft_sampling=_reseeded(sampling, POSITION_STREAM if verification is Verification.DRAWN else DRAFT_STREAM),
        target_sampling=_reseeded(sampling, POSITION_STREAM),
        verification=verification,
        logprobs=logprobs_options(request).request_for(sampling) if request.HasField("logprobs") else None,
        grammar=request_grammar(request, policy),
    )


def request_grammar(request: gateway_pb2.GenerateRequest, policy: RequestPolicy) -> RequestGrammar | None:
    """The request's structured output compiled (on the caller's thread: the tokenizer thread)."""
    if not request.HasField("structured_output"):
        return None
    output = structured_output_from_pb(request.structured_output, "structured_output")
    if policy.grammars is None:
        raise InvalidArgumentError("structured_output: this gateway serves no grammars", field="structured_output")
    field = f"structured_output.{request.structured_output.WhichOneof('kind')}"
    return policy.grammars.compile(grammar_text(output, field), field)


def logprobs_options(request: gateway_pb2.GenerateRequest) -> LogprobsOptions:
    """What the request asks for its logprobs; validation names the field."""
    return LogprobsOptions(request.logprobs.top_logprobs, request.logprobs.processed)


def speculation_method(spec: gateway_pb2.SpeculationOptions, policy: RequestPolicy) -> SpeculationMethod:
    """What the request may draft with: its `method`, else the gateway's default, NONE when
    speculation is off for it (`enabled`, or the gateway's default)."""
    if spec.method not in METHOD_FROM_PB:
        raise InvalidArgumentError(f"speculation.method: unknown value {spec.method}", field="speculation.method")
    asked = METHOD_FROM_PB[spec.method]
    # Naming a method opts in on a gateway that does not speculate by default.
    enabled = spec.enabled if spec.HasField("enabled") else policy.speculative or asked is not None
    if not enabled:
        if asked not in (None, SpeculationMethod.NONE):
            raise InvalidArgumentError(f"speculation.method: {asked.value} contradicts enabled = false",
                                       field="speculation.method")
        return SpeculationMethod.NONE
    method = asked if asked is not None else policy.default_method
    if method is SpeculationMethod.MODEL and not policy.has_draft:
        raise InvalidArgumentError("speculation.method: this gateway runs without a draft model; "
                                   "use ngram (lookups) or auto", field="speculation.method")
    return method


def verification_of(spec: gateway_pb2.SpeculationOptions, sampling: SamplingParams) -> Verification:
    """How the request's draft tokens are judged: as it asks, else DRAWN when it is seeded (its
    tokens then depend on its seed alone) and REJECTION otherwise."""
    if spec.verification not in VERIFICATION_FROM_PB:
        raise InvalidArgumentError(f"speculation.verification: unknown value {spec.verification}",
                                   field="speculation.verification")
    asked = VERIFICATION_FROM_PB[spec.verification]
    if asked is not None:
        return asked
    return Verification.REJECTION if sampling.seed is None else Verification.DRAWN


def method_to_pb(method: SpeculationMethod) -> gateway_pb2.SpeculationMethod:
    return next(pb for pb, m in METHOD_FROM_PB.items() if m is method)


def _reseeded(sampling: SamplingParams, stream: int) -> SamplingParams:
    """The same transforms with the seed of one of the request's independent random streams."""
    return dataclasses.replace(
        sampling, seed=None if sampling.seed is None else independent_seed(sampling.seed, stream))


def check_stop_strings(stop: list[str]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgumentError(f"stop: {len(stop)} strings, at most {MAX_STOP_STRINGS} are allowed", field="stop")
    for i, text in enumerate(stop):
        if not text:
            raise InvalidArgumentError(f"stop[{i}]: must not be empty", field=f"stop[{i}]")
        if len(text) > MAX_STOP_CHARS:
            raise InvalidArgumentError(f"stop[{i}]: {len(text)} characters, at most {MAX_STOP_CHARS} are allowed",
                                       field=f"stop[{i}]")


def check_prompt(prompt: list[int], max_seq_len: int, vocab_size: int) -> None:
    """Reject prompts the services would refuse, before they can fail a whole Prefill batch."""
    if not prompt:
        raise InvalidArgumentError("prompt: the prompt encodes to no tokens", field="prompt")
    if len(prompt) >= max_seq_len:
        raise InvalidArgumentError(
            f"prompt: {len(prompt)} tokens leave no room to generate within max_seq_len {max_seq_len}", field="prompt"
        )
    if max(prompt) >= vocab_size:
        raise InvalidArgumentError(f"prompt: token id {max(prompt)} is outside the target's vocabulary of {vocab_size}",
                                   field="prompt")


def check_logit_bias(sampling: SamplingParams, vocab_size: int) -> None:
    """The bias's token ids must lie in the target's vocabulary."""
    bad = [token for token, _ in sampling.logit_bias if token >= vocab_size]
    if bad:
        raise InvalidArgumentError(
            f"sampling.logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
            field="sampling.logit_bias")


def completion_to_pb(seq: Request, error: str) -> gateway_pb2.Completion:
    """The final message of a stream: why it ended, usage, speculation statistics, timings."""
    ttft = (seq.first_token_at or seq.finished_at or seq.created_at) - seq.created_at
    total = (seq.finished_at or seq.created_at) - seq.created_at
    decode_time = total - ttft
    rate = (seq.completion_tokens - 1) / decode_time if seq.completion_tokens > 1 and decode_time > 0 else 0.0
    return gateway_pb2.Completion(
        finish_reason=_FINISH_TO_PB[seq.finish_reason or FinishReason.ERROR],
        usage=gateway_pb2.Usage(prompt_tokens=len(seq.prompt), completion_tokens=seq.completion_tokens),
        speculation=gateway_pb2.SpeculationStats(
            acceptance_rate=seq.counts.acceptance_rate,
            mean_acceptance_length=seq.counts.mean_acceptance_length,
            num_rounds=seq.counts.rounds,
            num_draft_tokens=seq.counts.draft_tokens,
            num_accepted_tokens=seq.counts.accepted_tokens,
            num_plain_rounds=seq.counts.plain_rounds,
            num_lookup_rounds=seq.counts.lookup_rounds,
            num_lookup_draft_tokens=seq.counts.lookup_draft_tokens,
            num_lookup_accepted_tokens=seq.counts.lookup_accepted_tokens,
            num_guided_rounds=seq.counts.guided_rounds,
            num_guessed_tokens=seq.counts.guessed_tokens,
            num_forced_tokens=seq.counts.forced_tokens,
        ),
        timings=gateway_pb2.Timings(time_to_first_token_s=ttft, total_s=total, tokens_per_s=rate),
        error_message=error,
        anatomy=gateway_pb2.RoundAnatomy(**{f"{name}_s": value for name, value in seq.anatomy.seconds.items()}),
    )


def token_logprob_to_pb(token: TokenLogprob) -> gateway_pb2.TokenLogprob:
    return gateway_pb2.TokenLogprob(
        token_id=token.token_id, logprob=token.logprob,
        top=[gateway_pb2.TopLogprob(token_id=i, logprob=v) for i, v in token.top],
    )
