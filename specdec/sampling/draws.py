"""Seeded draws from next-token distributions: the generators of a request's random streams
and positions, and inverse-CDF sampling with one uniform a row.

Every token the services or the gateway draw goes through `sample` (or `pick_tokens`, which
takes the argmax of a greedy row), so a draw with a position's generator is the same draw
wherever it is made: the target's plain decoding and drawn verification, a first token at
the gateway, the draft's proposal under drawn verification.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.errors import InvalidArgumentError
from specdec.sampling.params import SamplingParams, independent_seed

#: A generator per row (None entries use torch's default RNG), ONE generator shared by
#: all rows, or None for torch's default RNG. Only per-row generators make a request's
#: draws independent of the batch it happens to share; the other two forms are for
#: large statistical batches and unseeded traffic.
Generators = Sequence[torch.Generator | None] | torch.Generator | None


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A request's own generator on `device`: seeded, or nondeterministically seeded."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def position_generator(params: SamplingParams, position: int, device: torch.device | str) -> torch.Generator | None:
    """The generator of a draw the target makes for the token at sequence `position` (plain
    decoding on the target, `VerifyItem.sampling`): seeded with `independent_seed(seed,
    position)`, so every position has its own uniform however calls, steps and preemptions
    split the work. None (torch's default generator) for a greedy or unseeded request."""
    if params.is_greedy or params.seed is None:
        return None
    return make_generator(independent_seed(params.seed, position), device)


#: The token `sample` returns for a row it cannot draw from: a negative, NaN or infinite
#: weight, or no positive weight at all (e.g. NaN logits, or logits overflowed by a tiny
#: temperature). The caller checks its host copy of the tokens (`drawn_tokens`): a check on
#: the device (`torch._assert_async`) would end the process's CUDA context instead of the call.
NO_TOKEN = -1


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row i's token whose cumulative-weight interval holds `uniforms[i]` x the row's total.

    weights [n, vocab] (non-negative, unnormalized), uniforms [n] in [0, 1) → [n] int64,
    `NO_TOKEN` for a row that is not a distribution.
    Draws token t with probability weights[t] / sum(weights), like `torch.multinomial`, but
    with one uniform per row where multinomial draws one exponential variate per token
    (docs/performance.md#inverse-cdf-sampling). The cumulative sum runs in float64, so a
    token's interval is its weight to ~1e-16 of the total.
    """
    cumulative = weights.double().cumsum(dim=-1)  # [n, vocab]
    total = cumulative[:, -1]  # [n]
    # amin, not all(weights >= 0): one reduction instead of a full boolean tensor.
    valid = (weights.amin(dim=-1) >= 0) & (total > 0) & torch.isfinite(total)  # [n]
    # u < 1 keeps u * total below the total (rounding cannot reach it), so the token found
    # is one with weight: its interval [cumulative[t-1], cumulative[t]) holds the target.
    target = uniforms.to(cumulative)[:, None] * total[:, None]  # [n, 1]
    tokens = torch.searchsorted(cumulative, target, right=True).view(-1)  # first token whose interval ends past target
    return torch.where(valid, tokens, NO_TOKEN)  # [n]


def drawn_tokens(tokens: torch.Tensor) -> list[int]:
    """Tokens [n] from `sample` (or holding its draws) as a host list: the one copy the caller
    makes, checked there (`check_drawn`)."""
    return check_drawn(tokens.tolist())


def check_drawn(tokens: list[int]) -> list[int]:
    """`tokens`, on the host; InvalidArgumentError if `sample` could not draw one (`NO_TOKEN`)."""
    if NO_TOKEN in tokens:
        raise InvalidArgumentError(
            f"sampling: row {tokens.index(NO_TOKEN)} of {len(tokens)} has no distribution to draw from "
            "(negative, NaN or infinite weights, or none positive: NaN logits, or logits overflowed "
            "by a temperature too small for them)"
        )
    return tokens


def sample(probs: torch.Tensor, generators: Generators = None) -> torch.Tensor:
    """One token per row of `probs` [n, vocab] (unnormalized weights allowed) → [n] int64.

    A row that is not a distribution (negative, NaN or infinite weights, or none positive)
    gets `NO_TOKEN`; copy the tokens to the host with `drawn_tokens`, which refuses it.

    Inverse-CDF sampling: one uniform draw per row. With a list of per-row generators each
    row's uniform comes from its own generator, so a seeded request gets the same tokens
    whatever else is batched with it. A single generator (or None = default RNG) draws the
    whole batch's uniforms at once.
    """
    n = probs.shape[0]
    if generators is None or isinstance(generators, torch.Generator):
        uniforms = torch.rand(n, dtype=torch.float64, device=probs.device, generator=generators)  # [n]
    else:
        if len(generators) != n:
            raise InvalidArgumentError(f"generators: got {len(generators)} for {n} rows", field="generators")
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=probs.device)
        uniforms = torch.cat([
            torch.rand(1, dtype=torch.float64, device=probs.device, generator=g) for g in generators
        ])  # [n]
    return _inverse_cdf(probs, uniforms)


def pick_tokens(
    probs: torch.Tensor,  # [n, vocab]
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Each row's next token from its distribution (`logits_to_probs`): the argmax for a greedy
    row, whose distribution is one-hot, and a draw with the row's own generator for the others.
    Returns [n] int64 (`NO_TOKEN` where a draw failed: see `drawn_tokens`)."""
    tokens = probs.argmax(dim=-1)  # [n]
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    if sampled:
        rows = torch.tensor(sampled, device=probs.device)  # [s]
        tokens = tokens.index_copy(0, rows, sample(probs.index_select(0, rows), [generators[i] for i in sampled]))
    return tokens
