"""Per-request sampling parameters, shared by the draft service and the gateway."""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdec.errors import InvalidArgumentError

_MAX_SEED = 2**64  # the wire carries the seed as uint64


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into a next-token distribution.

    The transforms run in `transformers`' order: repetition penalty, temperature,
    top-k, top-p, softmax (see `specdec.sampling.transforms`).
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

    def __post_init__(self) -> None:
        if not (_is_real(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidArgumentError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (_is_int(self.top_k) and self.top_k >= 0):
            raise InvalidArgumentError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not (_is_real(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (
            _is_real(self.repetition_penalty)
            and math.isfinite(self.repetition_penalty)
            and self.repetition_penalty > 0
        ):
            raise InvalidArgumentError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}"
            )
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < _MAX_SEED):
            raise InvalidArgumentError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")

    @property
    def is_greedy(self) -> bool:
        """True when the request decodes by argmax (temperature 0)."""
        return self.temperature == 0

    @property
    def greedy_by_raw_argmax(self) -> bool:
        """Greedy, and nothing moves the argmax of the raw logits (no repetition penalty;
        top-k and top-p always keep the largest logit): the argmax is all it needs."""
        return self.is_greedy and self.repetition_penalty == 1.0


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
