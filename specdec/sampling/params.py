"""Per-request sampling parameters, shared by the draft service and the gateway."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from specdec.errors import InvalidArgumentError

_MAX_SEED = 2**64  # the wire carries the seed as uint64
#: OpenAI's ranges: a bias of +-100 bans or forces a token; penalties beyond +-2 wreck the text.
MAX_LOGIT_BIAS = 100.0
MAX_OUTPUT_PENALTY = 2.0
#: A token id and the bias added to its logit.
LogitBias = tuple[tuple[int, float], ...]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into a next-token distribution.

    The transforms run in this order: logit bias, repetition penalty, presence and
    frequency penalties, temperature, top-k, top-p, min-p, softmax (see
    `specdec.sampling.transforms`).
    """

    #: 0 means greedy (argmax); otherwise logits are divided by it.
    temperature: float = 1.0
    #: Keep the k highest logits (ties at the k-th value kept); 0 disables.
    top_k: int = 0
    #: Nucleus mass in (0, 1]; 1 disables. At least one token is always kept.
    top_p: float = 1.0
    #: CTRL penalty (> 0) on tokens present in the context; 1 disables.
    repetition_penalty: float = 1.0
    #: Seed of the request's own generator; None means nondeterministic.
    seed: int | None = None
    #: Keep the tokens whose probability (after temperature) is at least min_p times the
    #: most likely token's; 0 disables. In [0, 1].
    min_p: float = 0.0
    #: (token id, bias) pairs, each bias in [-100, 100] added to the raw logit; stored sorted
    #: by id so equal biases compare and hash equal. Ids are checked against the vocabulary
    #: where it is known (the gateway, the services).
    logit_bias: LogitBias = ()
    #: Subtracted once from the logit of every token the output holds; in [-2, 2].
    presence_penalty: float = 0.0
    #: Subtracted from a token's logit once per occurrence in the output; in [-2, 2].
    frequency_penalty: float = 0.0
    #: Where the output starts in a slot's tokens: presence and frequency count only the
    #: tokens from this index on (OpenAI's semantics: generated tokens, not the prompt).
    #: The gateway sets it to the prompt length; the repetition penalty counts everything.
    penalty_start: int = 0

    def __post_init__(self) -> None:
        if not (_is_real(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidArgumentError(f"temperature must be a finite number >= 0, got {self.temperature!r}",
                                       field="temperature")
        if not (_is_int(self.top_k) and self.top_k >= 0):
            raise InvalidArgumentError(f"top_k must be an integer >= 0, got {self.top_k!r}", field="top_k")
        if not (_is_real(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p!r}", field="top_p")
        if not (
            _is_real(self.repetition_penalty)
            and math.isfinite(self.repetition_penalty)
            and self.repetition_penalty > 0
        ):
            raise InvalidArgumentError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}",
                field="repetition_penalty"
            )
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < _MAX_SEED):
            raise InvalidArgumentError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}",
                                       field="seed")
        if not (_is_real(self.min_p) and 0 <= self.min_p <= 1):
            raise InvalidArgumentError(f"min_p must be in [0, 1], got {self.min_p!r}", field="min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_real(value) and -MAX_OUTPUT_PENALTY <= value <= MAX_OUTPUT_PENALTY):
                raise InvalidArgumentError(f"{name} must be in [-2, 2], got {value!r}", field=name)
        if not (_is_int(self.penalty_start) and self.penalty_start >= 0):
            raise InvalidArgumentError(f"penalty_start must be an integer >= 0, got {self.penalty_start!r}",
                                       field="penalty_start")
        # Frozen: the normalized form replaces the given one, as __init__ would have stored it.
        object.__setattr__(self, "logit_bias", _checked_bias(self.logit_bias))

    @property
    def is_greedy(self) -> bool:
        """True when the request decodes by argmax (temperature 0)."""
        return self.temperature == 0

    @property
    def greedy_by_raw_argmax(self) -> bool:
        """Greedy, and nothing moves the argmax of the raw logits (no logit bias, no
        penalty; top-k, top-p and min-p always keep the largest logit): the argmax is all it needs."""
        return self.is_greedy and self.repetition_penalty == 1.0 and not self.uses_bias and not self.counts_output

    @property
    def uses_bias(self) -> bool:
        """True when some logit bias is not zero."""
        return any(bias != 0 for _, bias in self.logit_bias)

    @property
    def counts_output(self) -> bool:
        """True when a presence or frequency penalty needs the output's token counts."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0


def _checked_bias(given: LogitBias | Mapping[int, float]) -> LogitBias:
    """`given` as (id, bias) pairs sorted by id; InvalidArgumentError names a bad entry."""
    pairs = list(given.items()) if isinstance(given, Mapping) else list(given)
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise InvalidArgumentError(f"logit_bias must hold (token id, bias) pairs, got {pair!r}", field="logit_bias")
        token, bias = pair
        if not (_is_int(token) and token >= 0):
            raise InvalidArgumentError(f"logit_bias: token id {token!r} must be an integer >= 0", field="logit_bias")
        if not (_is_real(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            raise InvalidArgumentError(f"logit_bias: the bias of token {token} must be in [-100, 100], got {bias!r}",
                                       field="logit_bias")
    pairs.sort()
    for (a, _), (b, _) in zip(pairs, pairs[1:]):
        if a == b:
            raise InvalidArgumentError(f"logit_bias: token id {a} appears more than once", field="logit_bias")
    return tuple((int(token), float(bias)) for token, bias in pairs)


def independent_seed(seed: int, stream: int) -> int:
    """A seed for random stream number `stream` of a request seeded with `seed`.

    Speculative sampling needs the draft's draws (which token to propose) and the
    gateway's draws (accept or not, recovered token) to be independent. Seeding both
    generators with the request's own seed would correlate them, so each side derives
    its own seed with this splitmix64 mix. Deterministic: seeded requests reproduce.
    """
    z = (seed + (stream + 1) * 0x9E3779B97F4A7C15) % _MAX_SEED
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % _MAX_SEED
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % _MAX_SEED
    return z ^ (z >> 31)
