"""A small synchronous Python client for the gateway.

    from specdec.client import SpecdecClient

    with SpecdecClient("127.0.0.1:50050") as client:
        for chunk in client.stream("Tell me a joke", max_new_tokens=64):
            print(chunk.text, end="", flush=True)
        result = client.generate([{"role": "user", "content": "Hi!"}], temperature=0.7, seed=1)
        print(result.text, result.acceptance_rate)
        scored = client.generate("The sky is", max_new_tokens=8, logprobs=5)
        print([(t.token_id, t.logprob, t.top) for t in scored.logprobs])
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from specdec.serving.security import bearer_metadata, channel_credentials, read_token
from specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

Prompt = str | Sequence[Mapping[str, str]]
#: `SpeculationOptions.method` by name.
METHODS = {
    "auto": gateway_pb2.SPECULATION_METHOD_AUTO, "model": gateway_pb2.SPECULATION_METHOD_MODEL,
    "ngram": gateway_pb2.SPECULATION_METHOD_NGRAM, "none": gateway_pb2.SPECULATION_METHOD_NONE,
}
VERIFICATIONS = {"rejection": gateway_pb2.VERIFICATION_REJECTION, "drawn": gateway_pb2.VERIFICATION_DRAWN}
#: gRPC retries a call that failed UNAVAILABLE before any response: a draining gateway refuses
#: so, having generated nothing, and a balancer sends the retry to another one. A stream that
#: has sent a token is never retried (gRPC commits a call at its first response). Until the
#: balancer's next health check the draining gateway still gets calls, and a least-connections
#: balancer gives it every retry (it refuses at once, so it holds the fewest): gRPC waits
#: random(0, 0.5 s × 2^n) before retry n + 1, so that four retries outlast a check interval
#: (docs/deployment.md#behind-a-load-balancer).
RETRY_POLICY = {"maxAttempts": 5, "initialBackoff": "0.5s", "maxBackoff": "4s", "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"]}
CHANNEL_OPTIONS = [
    ("grpc.enable_retries", 1),
    ("grpc.service_config", json.dumps({"methodConfig": [{"name": [{"service": "specdec.v1.Gateway"}],
                                                          "retryPolicy": RETRY_POLICY}]})),
]


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one generated token at its position, and the most
    likely alternatives there (token id, logprob), the most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)

    @classmethod
    def from_pb(cls, message: gateway_pb2.TokenLogprob) -> TokenLogprob:
        return cls(message.token_id, message.logprob, [(t.token_id, t.logprob) for t in message.top])


@dataclass
class GenerationResult:
    """A finished generation, assembled from the stream."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    acceptance_rate: float = 0.0
    mean_acceptance_length: float = 0.0
    #: Speculation rounds (K >= 1), draft tokens proposed and accepted over the request,
    #: and rounds that drafted nothing (plain decoding).
    num_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_plain_rounds: int = 0
    #: The share of rounds, draft tokens and accepted tokens that lookups drafted (no draft model).
    num_lookup_rounds: int = 0
    num_lookup_draft_tokens: int = 0
    num_lookup_accepted_tokens: int = 0
    #: Model-drafted rounds that checked a lookup's guess, and the draft tokens the guesses gave.
    num_guided_rounds: int = 0
    num_guessed_tokens: int = 0
    #: Draft tokens a grammar forced: drafted with no draft step, kept for certain.
    num_forced_tokens: int = 0
    time_to_first_token_s: float = 0.0
    tokens_per_s: float = 0.0
    total_s: float = 0.0
    #: Seconds the request's rounds spent per phase (draft_compute, verify_compute, rpc, accept, other).
    anatomy: dict[str, float] = field(default_factory=dict)
    #: Token ids of each streamed message, to see how many tokens each round delivered.
    chunks: list[list[int]] = field(default_factory=list)
    #: One per token of `token_ids` when the request asked for logprobs, else empty.
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "num_rounds": self.num_rounds,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_plain_rounds": self.num_plain_rounds,
            "num_lookup_rounds": self.num_lookup_rounds,
            "num_lookup_draft_tokens": self.num_lookup_draft_tokens,
            "num_lookup_accepted_tokens": self.num_lookup_accepted_tokens,
            "num_guided_rounds": self.num_guided_rounds,
            "num_guessed_tokens": self.num_guessed_tokens,
            "num_forced_tokens": self.num_forced_tokens,
            "time_to_first_token_s": round(self.time_to_first_token_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
            **({"logprobs": [{"token_id": t.token_id, "logprob": t.logprob,
                              "top": [{"token_id": i, "logprob": v} for i, v in t.top]} for t in self.logprobs]}
               if self.logprobs else {}),
        }


def build_request(
    prompt: Prompt,
    *,
    max_new_tokens: int = 0,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    min_p: float = 0.0,
    logit_bias: Mapping[int, float] | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    speculative: bool | None = None,
    num_speculative_tokens: int | None = None,
    adaptive: bool | None = None,
    method: str | None = None,
    verification: str | None = None,
    logprobs: int | None = None,
    processed_logprobs: bool = False,
    json_schema: Mapping[str, object] | str | None = None,
    json_object: bool = False,
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    grammar: str | None = None,
) -> gateway_pb2.GenerateRequest:
    """A GenerateRequest: a string is a raw prompt, a list of {role, content} is a chat.
    `logit_bias` maps token ids to a bias in [-100, 100]; presence and frequency penalties
    count the generated tokens only (OpenAI's semantics).
    `method` is what to draft with: "auto", "model", "ngram" or "none" (default: the gateway's).
    `verification` is how a sampled request's draft tokens are judged: "rejection" or "drawn"
    (default: drawn when seeded, so the tokens depend on the seed alone; see gateway.proto).
    `logprobs` asks for each token's logprob with that many alternatives (0..20; None: no
    logprobs), from the model's raw distribution or, with `processed_logprobs`, from the
    distribution after the request's transforms.
    At most one of `json_schema` (a dict or JSON text), `json_object`, `regex`, `choice` (the
    allowed strings) and `grammar` (llguidance Lark or GBNF) constrains the completion."""
    sampling = common_pb2.SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty, min_p=min_p,
        logit_bias=dict(logit_bias or {}), presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        seed=seed,
    )
    speculation = speculation_options(speculative, num_speculative_tokens, adaptive, method, verification)
    request = gateway_pb2.GenerateRequest(
        max_new_tokens=max_new_tokens, sampling=sampling, stop=list(stop), speculation=speculation
    )
    output = structured_output(json_schema, json_object, regex, choice, grammar)
    if output is not None:
        request.structured_output.CopyFrom(output)
    if logprobs is not None:
        request.logprobs.CopyFrom(gateway_pb2.LogprobsOptions(top_logprobs=logprobs, processed=processed_logprobs))
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.chat.messages.extend(gateway_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
    return request


def structured_output(
    json_schema: Mapping[str, object] | str | None = None, json_object: bool = False, regex: str | None = None,
    choice: Sequence[str] | None = None, grammar: str | None = None,
) -> gateway_pb2.StructuredOutput | None:
    """The `StructuredOutput` of whichever one is given (None for none; ValueError for several)."""
    given = [(name, value) for name, value in (("json_schema", json_schema), ("json_object", json_object or None),
                                              ("regex", regex), ("choice", choice), ("grammar", grammar))
             if value is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one of json_schema, json_object, regex, choice, grammar; got "
                         f"{', '.join(name for name, _ in given)}")
    if not given:
        return None
    output = gateway_pb2.StructuredOutput()
    if json_schema is not None:
        output.json_schema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    elif json_object:
        output.json_object.SetInParent()
    elif regex is not None:
        output.regex = regex
    elif choice is not None:
        output.choice.options.extend(choice)
    elif grammar is not None:
        output.grammar = grammar
    return output


def speculation_options(
    speculative: bool | None, num_speculative_tokens: int | None, adaptive: bool | None, method: str | None,
    verification: str | None,
) -> gateway_pb2.SpeculationOptions:
    """`SpeculationOptions` with the fields that are not None (the gateway's defaults for the rest)."""
    speculation = gateway_pb2.SpeculationOptions()
    if speculative is not None:
        speculation.enabled = speculative
    if num_speculative_tokens is not None:
        speculation.num_speculative_tokens = num_speculative_tokens
    if adaptive is not None:
        speculation.adaptive = adaptive
    for name, value, choices in (("method", method, METHODS), ("verification", verification, VERIFICATIONS)):
        if value is None:
            continue
        if value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        setattr(speculation, name, choices[value])
    return speculation


class SpecdecClient:
    """Blocking client of the gateway's Generate and Info rpcs.

    TLS when `tls_ca` (the CA of the gateway's certificate) is given, mutual TLS with
    `tls_cert` / `tls_key` too; `token` is sent as a bearer token (default: `$SPECDEC_AUTH_TOKEN`).
    A request refused before its first token (UNAVAILABLE) is retried (`RETRY_POLICY`).
    """

    def __init__(
        self, address: str = "127.0.0.1:50050", *, timeout: float | None = None,
        tls_ca: str = "", tls_cert: str = "", tls_key: str = "", token: str | None = None,
    ) -> None:
        credentials = channel_credentials(tls_ca, tls_cert, tls_key)
        self.channel = (grpc.secure_channel(address, credentials, CHANNEL_OPTIONS) if credentials
                        else grpc.insecure_channel(address, CHANNEL_OPTIONS))
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.timeout = timeout
        self.metadata = bearer_metadata(read_token() if token is None else token) or None

    def __enter__(self) -> SpecdecClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def info(self) -> gateway_pb2.GatewayInfo:
        return self.stub.Info(common_pb2.InfoRequest(), timeout=self.timeout, wait_for_ready=True,
                              metadata=self.metadata)

    def stream(self, prompt: Prompt, **options: object) -> Iterator[gateway_pb2.GenerateResponse]:
        """The raw response stream; raises grpc.RpcError on a non-OK status."""
        request = build_request(prompt, **options)  # type: ignore[arg-type]
        return self.stub.Generate(request, timeout=self.timeout, wait_for_ready=True, metadata=self.metadata)

    def generate(self, prompt: Prompt, **options: object) -> GenerationResult:
        """Run a generation to the end and return the assembled result."""
        return collect(self.stream(prompt, **options))


def collect(
    responses: Iterator[gateway_pb2.GenerateResponse], on_text: Callable[[str], object] | None = None
) -> GenerationResult:
    """Assemble a stream into a result, passing each text delta to `on_text` as it arrives."""
    result = GenerationResult()
    for response in responses:
        if on_text is not None and response.text:
            on_text(response.text)
        if response.token_ids:
            result.chunks.append(list(response.token_ids))
        result.token_ids.extend(response.token_ids)
        result.logprobs.extend(TokenLogprob.from_pb(t) for t in response.logprobs)
        result.text += response.text
        if response.HasField("completion"):
            apply_completion(result, response.completion)
    return result


def apply_completion(result: GenerationResult, completion: gateway_pb2.Completion) -> None:
    result.finish_reason = (
        gateway_pb2.FinishReason.Name(completion.finish_reason).removeprefix("FINISH_REASON_").lower()
    )
    result.prompt_tokens = completion.usage.prompt_tokens
    result.completion_tokens = completion.usage.completion_tokens
    result.acceptance_rate = completion.speculation.acceptance_rate
    result.mean_acceptance_length = completion.speculation.mean_acceptance_length
    result.num_rounds = completion.speculation.num_rounds
    result.num_draft_tokens = completion.speculation.num_draft_tokens
    result.num_accepted_tokens = completion.speculation.num_accepted_tokens
    result.num_plain_rounds = completion.speculation.num_plain_rounds
    result.num_lookup_rounds = completion.speculation.num_lookup_rounds
    result.num_lookup_draft_tokens = completion.speculation.num_lookup_draft_tokens
    result.num_lookup_accepted_tokens = completion.speculation.num_lookup_accepted_tokens
    result.num_guided_rounds = completion.speculation.num_guided_rounds
    result.num_guessed_tokens = completion.speculation.num_guessed_tokens
    result.num_forced_tokens = completion.speculation.num_forced_tokens
    result.time_to_first_token_s = completion.timings.time_to_first_token_s
    result.tokens_per_s = completion.timings.tokens_per_s
    result.total_s = completion.timings.total_s
    anatomy = completion.anatomy
    result.anatomy = {f.name.removesuffix("_s"): getattr(anatomy, f.name) for f in anatomy.DESCRIPTOR.fields}
