"""The benchmark's chat prompts and one measured request through the gateway.

The prompts ask for long answers (so most requests run to `max_new_tokens`) and none of
them appears in the tests. A request's decode speed is the gateway's own
`tokens_per_s`: completion tokens after the first over the time after the first token,
so prefill and queueing stay out of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from specdec.client import GenerationResult, SpecdecClient
from specdec_bench.texts import COPY_HEAVY_PROMPTS, LONG_CONTEXT_PROMPTS

#: Deadline of one request; generous, a crowded 2-core machine is slow.
REQUEST_TIMEOUT_S = 900.0

PROMPTS: tuple[str, ...] = (
    "Explain how the gears on a bicycle make it easier to ride up a steep hill.",
    "Describe the life cycle of a butterfly, from egg to adult, in detail.",
    "Give step-by-step instructions for planting a small vegetable garden.",
    "What are the main differences between a list and a dictionary in Python? Give examples.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Why do leaves change colour in autumn? Explain the chemistry simply.",
    "Write a polite email asking a colleague to review a project proposal by Friday.",
    "Describe how a volcano forms and what happens during an eruption.",
)


class Workload(Enum):
    """A set of prompts the drafting methods are compared on (`sweeps.method_comparison`)."""

    #: Edits, rewrites, quoting and structured transforms of a short given text.
    COPY_HEAVY = "copy-heavy"
    #: Questions answered by quoting or extracting a document of 1,500+ tokens.
    LONG_CONTEXT = "long-context"
    #: The chat prompts of W1, which copy little: the lookups must not cost there.
    CHAT = "chat"

    def prompts(self, chat_prompts: int) -> tuple[str, ...]:
        """The workload's prompts; chat uses the first `chat_prompts` of `PROMPTS`."""
        if self is Workload.COPY_HEAVY:
            return COPY_HEAVY_PROMPTS
        if self is Workload.LONG_CONTEXT:
            return LONG_CONTEXT_PROMPTS
        return PROMPTS[:chat_prompts]


class DraftMethod(Enum):
    """What a request drafts with; the values are `SpeculationOptions.method` names."""

    PLAIN = "none"
    MODEL = "model"
    #: Lookups only, sent to a gateway that has no draft service.
    NGRAM = "ngram"
    #: The model draft or a lookup, chosen per round by the gateway's planner.
    AUTO = "auto"

    @property
    def k(self) -> int | None:
        """The `run_request` K: 0 (plain) or None (the gateway's adaptive K)."""
        return 0 if self is DraftMethod.PLAIN else None


def chat(prompt: str) -> list[dict[str, str]]:
    """A one-turn chat with `prompt` as the user's message."""
    return [{"role": "user", "content": prompt}]


def mode_name(k: int | None) -> str:
    """`plain` (K = 0), `speculative` (the gateway's adaptive default) or `K=<k>` (fixed)."""
    return "plain" if k == 0 else "speculative" if k is None else f"K={k}"


def speculation_options(k: int | None) -> dict[str, object]:
    """Request options for `mode_name(k)`: K = 0 is plain, None the gateway's adaptive default."""
    if k == 0:
        return {"speculative": False}
    if k is None:
        return {}
    return {"num_speculative_tokens": k, "adaptive": False}


@dataclass
class RunRecord:
    """One request as measured through the gateway (everything the analysis needs)."""

    phase: str
    prompt: int
    #: 0 = plain, None = speculative with the gateway's adaptive K, else a fixed K.
    k: int | None
    temperature: float
    repetition: int
    tokens_per_s: float
    time_to_first_token_s: float
    total_s: float
    completion_tokens: int
    num_rounds: int
    num_draft_tokens: int
    num_accepted_tokens: int
    #: Seconds per round phase (draft_compute, verify_compute, rpc, accept, other), summed.
    anatomy: dict[str, float]
    #: Requests in flight together (1 outside the concurrency sweep).
    concurrency: int = 1
    #: Rounds that drafted nothing for this request (None in results recorded before the
    #: gateway reported them).
    num_plain_rounds: int | None = None
    #: From the gateway's metrics around this request (fixed-K sweep only): speculation
    #: rounds, and accepted draft tokens per position 0..K-1.
    num_drafts: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    #: `DraftMethod` value the request named ("" = the gateway's default, the model draft here).
    method: str = ""
    #: `Workload` value of the method comparison ("" elsewhere).
    workload: str = ""
    prompt_tokens: int = 0
    #: Rounds, draft and accepted tokens that lookups proposed (part of num_rounds and
    #: num_draft / num_accepted_tokens).
    num_lookup_rounds: int = 0
    num_lookup_draft_tokens: int = 0
    num_lookup_accepted_tokens: int = 0
    #: Model-drafted rounds that checked a lookup's guess, and the draft tokens the guesses gave.
    num_guided_rounds: int = 0
    num_guessed_tokens: int = 0
    #: Seconds from the moment its stack answered to the request's start (first-second scenario only).
    start_s: float | None = None

    @property
    def mode(self) -> str:
        return mode_name(self.k)

    @property
    def inter_token_s(self) -> float:
        """Mean time between tokens after the first (the request's own inter-token latency)."""
        if self.completion_tokens < 2:
            return 0.0
        return (self.total_s - self.time_to_first_token_s) / (self.completion_tokens - 1)


def run_request(
    client: SpecdecClient,
    phase: str,
    prompt: int,
    k: int | None,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
    repetition: int = 0,
    concurrency: int = 1,
    prompts: tuple[str, ...] = PROMPTS,
    method: DraftMethod | None = None,
    json_schema: Mapping[str, object] | None = None,
) -> tuple[RunRecord, GenerationResult]:
    """Send `prompts[prompt]` as a chat and return its record and the full result; `method`
    None drafts with the gateway's default (`DraftMethod.PLAIN` goes with k = `method.k`);
    `json_schema` constrains the answer."""
    options = speculation_options(k)
    if json_schema is not None:
        options["json_schema"] = json_schema
    if method is not None and method is not DraftMethod.PLAIN:
        options["method"] = method.value
    if temperature > 0:
        # Seeded so that runs repeat, but judged as unseeded traffic is (rejection sampling): a seed
        # alone would switch the request to drawn verification (docs/performance.md, "Drawn
        # verification's acceptance"), which keeps fewer draft tokens.
        options |= {"seed": seed, "verification": "rejection"}
    result = client.generate(
        chat(prompts[prompt]), max_new_tokens=max_new_tokens, temperature=temperature, **options,
    )
    if result.finish_reason not in ("length", "stop"):
        raise RuntimeError(f"{mode_name(k)} request on prompt {prompt} finished with {result.finish_reason!r}")
    record = RunRecord(
        phase=phase, prompt=prompt, k=k, temperature=temperature, repetition=repetition,
        tokens_per_s=result.tokens_per_s, time_to_first_token_s=result.time_to_first_token_s,
        total_s=result.total_s, completion_tokens=result.completion_tokens, num_rounds=result.num_rounds,
        num_draft_tokens=result.num_draft_tokens, num_accepted_tokens=result.num_accepted_tokens,
        anatomy=dict(result.anatomy), concurrency=concurrency, num_plain_rounds=result.num_plain_rounds,
        method=method.value if method is not None else "", prompt_tokens=result.prompt_tokens,
        num_lookup_rounds=result.num_lookup_rounds, num_lookup_draft_tokens=result.num_lookup_draft_tokens,
        num_lookup_accepted_tokens=result.num_lookup_accepted_tokens,
        num_guided_rounds=result.num_guided_rounds, num_guessed_tokens=result.num_guessed_tokens,
    )
    return record, result
