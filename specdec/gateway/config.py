"""Gateway configuration, validated at construction; its fields are the gateway's flags."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdec.errors import InvalidArgumentError
from specdec.flags import option
from specdec.gateway.draft_sources import SpeculationMethod
from specdec.gateway.proposers import DEFAULT_LOOKUP, LookupSettings
from specdec.serving.config import DEFAULT_DRAIN_TIMEOUT_S
from specdec.serving.security import ServerSecurity
from specdec.stats import DEFAULT_PREFIX, check_metrics_prefix
from specdec.wire.limits import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_MAX_REQUEST_BYTES

PROBS_DTYPES = ("float32", "bfloat16")
#: `--tool-call-parser` choices (`specdec.gateway.tools.family.PARSER_CHOICES`; not imported: the
#: config stays light for the command line).
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json")
#: `--speculation-method` choices (a request may also ask for "none").
SPECULATION_METHODS = tuple(m.value for m in SpeculationMethod if m is not SpeculationMethod.NONE)
DEFAULT_DECODE_STEPS = 4


#: K when it is fixed (--no-adaptive-k) and not given: long enough for an accurate draft,
#: short enough that a rejection early in the round wastes little.
DEFAULT_FIXED_K = 8


@dataclass(frozen=True)
class GatewayConfig(ServerSecurity):
    """Where the model services are, how the gateway speculates and how much it admits; its own
    TLS and token settings come from `ServerSecurity`, those toward the services are `service_*`."""

    target_address: str = option(
        "", "target service address, host:port (required); a gRPC address list (ipv4:host:port,host:port) "
        "fails over: requests resume on the next that answers", aliases=["--target"])
    draft_address: str = option(
        "", "draft service address, host:port; empty runs without a draft model (lookup drafting only)",
        aliases=["--draft"],
    )
    #: Slot ids carry it, and the services hold this gateway's slots under a lease in its
    #: name: a restart under the same name frees the slots the previous run left behind.
    instance_id: str = option(
        "", "stable name of this gateway instance, e.g. its pod name (empty = host:port, or a random name with "
        "port 0)", advanced=True,
    )
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(50050, "gateway port (0 = any free port)")
    #: Requests may opt out (or in, when this is off).
    speculative: bool = option(True, "speculate by default; --no-speculative decodes plainly unless a request asks")
    #: K unless a request asks for another value; with adaptive_k, the largest K the planner may
    #: choose (`k_for`).
    num_speculative_tokens: int = option(
        0, "draft tokens per round, K (the upper bound with --adaptive-k); 0: the services' largest K with "
        f"--adaptive-k and their measured costs, else {DEFAULT_FIXED_K}",
    )
    #: Structured-output requests draft the tokens their grammar forces (`grammar.rounds`).
    grammar_drafts: bool = option(
        True, "draft the tokens a structured-output request's grammar allows alone (no draft step, kept for "
        "certain); --no-grammar-drafts leaves them to the planned draft", advanced=True,
    )
    #: Requests may name another (`SpeculationOptions.method`); `model` needs a draft service.
    speculation_method: str = option(
        "auto", "what requests draft with unless they say: auto (the model draft or a lookup, chosen per round), "
        "model (the draft model only), ngram (lookups only)", choices=SPECULATION_METHODS, advanced=True,
    )
    #: Lookups match the last n tokens, n from the maximum down to the minimum
    #: (`specdec.gateway.proposers`); a longer match is likelier to continue alike.
    ngram_min: int = option(DEFAULT_LOOKUP.min_n, "shortest n-gram a lookup matches", advanced=True)
    ngram_max: int = option(DEFAULT_LOOKUP.max_n, "longest n-gram a lookup matches", advanced=True)
    #: A lookup first, the model continuing (docs/architecture.md#drafting-without-a-draft-model).
    lookup_guesses: bool = option(
        True, "let the draft model check lookups as guesses: a request's lookup in its first forward, where that "
        "pays, and its own lookups as it drafts",
        advanced=True,
    )
    #: The target's keys and values fill a self-draft's cache (`specdec.gateway.kv_handoff`).
    kv_handoff: bool = option(
        True, "where the draft is the target's own weights (quantized or cut), copy the target's KV cache into the "
        "draft's when the draft falls behind (a new prompt) instead of having it compute its own",
        advanced=True,
    )
    #: Prompt lookup through the edits an answer makes to what it copies (`proposers.edits`).
    lookup_edits: int = option(
        DEFAULT_LOOKUP.max_edits, "edits (renamed or reformatted tokens) a request's lookups learn from its answer "
        "and repeat wherever it copies them again (0 = off)", advanced=True,
    )
    #: Memory of the cross-request suffix cache: recorded output tokens, the oldest evicted first.
    suffix_cache_tokens: int = option(
        DEFAULT_LOOKUP.suffix_cache_tokens, "recent output tokens of all requests kept for suffix proposals (0 = off)",
        advanced=True,
    )
    #: K = 0 when speculation does not pay, e.g. in crowded rounds on a compute-bound target.
    adaptive_k: bool = option(
        True, "choose K in 0..--num-speculative-tokens each round from measured costs and acceptance",
    )
    #: vLLM's multi-step scheduling, for plain rounds: n steps share one call's fixed cost
    #: (docs/performance.md#call-cost-and-multi-step-plain-rounds); tokens then stream n at a time.
    decode_steps: int = option(
        DEFAULT_DECODE_STEPS, "tokens a plain round decodes per request in one target call (1 = one step a call; "
        "a request that drafts by lookup takes one where calls cost little against a step)",
        advanced=True,
    )
    default_max_new_tokens: int = option(256, "completion length of requests that set none", flag="max-new-tokens")
    max_batch_size: int = option(16, "requests decoded together; more wait in the queue")
    #: docs/deployment.md#shared-pools: no request is preempted for another gateway's, at the
    #: cost of the concurrency that pools overcommitted on demand give.
    reserve_kv_growth: bool = option(
        False, "in pools shared with other gateways, admit a request only where its whole length fits beside "
        "every running request's (off: admit on demand and preempt as answers grow)", advanced=True,
    )
    max_queue: int = option(
        64, "requests waiting for admission; beyond this Generate answers RESOURCE_EXHAUSTED (HTTP: 429)",
        advanced=True,
    )
    draft_probs_dtype: str = option(
        "float32", "wire precision of the draft's q vectors (exact either way; bf16 halves them)",
        choices=PROBS_DTYPES, advanced=True,
    )
    #: The gateway's tensor work (acceptance) is small and runs while both services wait; a
    #: second OpenMP thread would spin on after it and take a core from the target's next
    #: forward (docs/performance.md, "The gateway computes on one OpenMP thread").
    threads: int = option(1, "intra-op threads of the gateway's own tensor work (0 = one per core)", advanced=True)
    metrics_port: int = option(-1, "Prometheus /metrics port (-1 = off, 0 = any free port)")
    #: Same host, TLS settings, bearer token and request limits as the gRPC port (docs/openai.md).
    #: Off for the bare gateway, which deployments configure port by port; `specdec serve` turns it on.
    http_port: int = option(-1, "OpenAI-compatible HTTP port (-1 = off, 0 = any free port)")
    #: The HTTP front's tools (docs/openai.md#tools); `auto` reads the family from the chat template.
    tool_call_parser: str = option(
        "auto", "how the model writes tool calls: hermes (<tool_call> tags, ChatML models), llama3_json (Llama "
        "3.x JSON calls) or auto (from the chat template)", choices=TOOL_CALL_PARSERS, advanced=True,
    )
    metrics_prefix: str = option(
        DEFAULT_PREFIX, "prefix of every metric name; 'vllm:' gives vLLM's names", advanced=True,
    )
    #: Client requests are small (a prompt, options); replies from the services are large (logits).
    max_request_bytes: int = option(
        DEFAULT_MAX_REQUEST_BYTES,
        "largest Generate / Info request accepted; larger ones get RESOURCE_EXHAUSTED (HTTP: 413)",
        advanced=True,
    )
    max_message_bytes: int = option(
        DEFAULT_MAX_MESSAGE_BYTES, "largest gRPC message exchanged with the model services", advanced=True,
    )
    drain_timeout_s: float = option(
        DEFAULT_DRAIN_TIMEOUT_S, "on SIGTERM: seconds in-flight requests get to finish while new ones are refused "
        "(UNAVAILABLE, HTTP 503) and health says NOT_SERVING; then the rest are cancelled", advanced=True,
    )
    #: Deadline of a call to a model service: factor x its expected compute, at least the floor.
    rpc_timeout_floor_s: float = option(
        10.0, "shortest deadline of a call to a model service, in seconds", advanced=True,
    )
    service_tls_ca: str = option(
        "", "PEM CA to verify the model services' certificates (TLS toward the services)", advanced=True,
    )
    service_tls_cert: str = option(
        "", "PEM certificate the gateway presents to the model services (mutual TLS)", advanced=True,
    )
    service_tls_key: str = option("", "PEM private key of --service-tls-cert", advanced=True)
    service_auth_token_file: str = option(
        "", "file holding the bearer token the model services demand", advanced=True,
    )
    #: A message on a kept stream costs less than a new call (`specdec.gateway.streamed_rpc`);
    #: unary calls suit a proxy that drops idle streams.
    streamed_calls: bool = option(
        True, "carry each round's Propose and Verify on one kept stream per service (--no-streamed-calls: a "
        "unary call each)", advanced=True,
    )
    rpc_timeout_factor: float = option(
        20.0, "a call's deadline in multiples of its expected compute (from the measured costs)", advanced=True,
    )
    #: Notices a service that vanished without closing its connections (`specdec.wire.keepalive`).
    keepalive_s: float = option(
        10.0, "seconds between keepalive pings on each connection to a model service (0 = none); at least the "
        "services' --min-ping-interval-s", advanced=True,
    )
    keepalive_timeout_s: float = option(
        5.0, "seconds a keepalive ping may go unanswered before the connection is closed", advanced=True,
    )

    def __post_init__(self) -> None:
        self.check_security()
        if bool(self.service_tls_cert) != bool(self.service_tls_key):
            raise InvalidArgumentError("service_tls_cert and service_tls_key go together: set both or neither",
                                       field="service_tls_cert")
        for name in ("service_tls_ca", "service_tls_cert", "service_tls_key", "service_auth_token_file"):
            if getattr(self, name) and not Path(getattr(self, name)).is_file():
                raise InvalidArgumentError(f"{name}: {getattr(self, name)!r} is not a readable file", field=name)
        if not self.target_address:
            raise InvalidArgumentError("target_address is required", field="target_address")
        if self.speculation_method not in SPECULATION_METHODS:
            raise InvalidArgumentError(
                f"speculation_method must be one of {SPECULATION_METHODS}, got {self.speculation_method!r}",
                field="speculation_method"
            )
        if self.speculation_method == "model" and not self.draft_address:
            raise InvalidArgumentError("speculation_method model needs a draft: set draft_address, or use auto / ngram",
                                       field="speculation_method")
        if self.lookup_edits < 0:
            raise InvalidArgumentError(f"lookup_edits must be >= 0, got {self.lookup_edits}", field="lookup_edits")
        self.lookup_settings()  # validates the n-gram lengths and the cache size
        if self.num_speculative_tokens < 0:
            raise InvalidArgumentError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}",
                                       field="num_speculative_tokens")
        positive = (
            "decode_steps", "default_max_new_tokens", "max_batch_size", "max_queue", "max_request_bytes",
            "max_message_bytes",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise InvalidArgumentError(f"{name} must be > 0, got {getattr(self, name)}", field=name)
        if self.threads < 0:
            raise InvalidArgumentError(f"threads must be >= 0, got {self.threads}", field="threads")
        if not self.drain_timeout_s >= 0:  # also refuses NaN
            raise InvalidArgumentError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}",
                                       field="drain_timeout_s")
        if self.rpc_timeout_floor_s <= 0 or self.rpc_timeout_factor < 1:
            raise InvalidArgumentError("rpc_timeout_floor_s must be > 0 and rpc_timeout_factor >= 1",
                                       field="rpc_timeout_floor_s")
        if not self.keepalive_s >= 0 or not self.keepalive_timeout_s > 0:  # also refuses NaN
            raise InvalidArgumentError("keepalive_s must be >= 0 and keepalive_timeout_s > 0", field="keepalive_s")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise InvalidArgumentError(
                f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}",
                field="tool_call_parser"
            )
        if self.draft_probs_dtype not in PROBS_DTYPES:
            raise InvalidArgumentError(
                f"draft_probs_dtype must be one of {PROBS_DTYPES}, got {self.draft_probs_dtype!r}",
                field="draft_probs_dtype"
            )
        check_metrics_prefix(self.metrics_prefix)
        if not 0 <= self.port <= 65535 or not -1 <= self.metrics_port <= 65535 or not -1 <= self.http_port <= 65535:
            raise InvalidArgumentError("port, metrics_port and http_port must be valid port numbers")

    def k_for(self, services_max: int, costs_known: bool = True) -> int:
        """K for requests that name none, where the services accept at most `services_max`: the
        flag's, or by default their largest under adaptive K with the services' costs known
        (the planner drafts only as long as pays, and long copies pay at the longest K), and
        DEFAULT_FIXED_K where K stays fixed (no adaptive K, or no costs to adapt by)."""
        if self.num_speculative_tokens:
            return self.num_speculative_tokens
        return services_max if self.adaptive_k and costs_known else min(DEFAULT_FIXED_K, services_max)

    def lookup_settings(self) -> LookupSettings:
        return LookupSettings(self.ngram_min, self.ngram_max, self.suffix_cache_tokens, max_edits=self.lookup_edits)
