"""Logits → next-token distribution, and seeded sampling from it.

The ONE implementation of the sampling transforms: the draft service uses it to get the
q it samples from, the gateway to get p from the target's logits. Exactness of
speculative sampling rests on both sides applying the same transforms, so there is
no second copy anywhere.

Order and semantics follow `transformers` exactly (tested against its processors):
repetition penalty (`RepetitionPenaltyLogitsProcessor`), temperature
(`TemperatureLogitsWarper`), top-k (`TopKLogitsWarper`: ties with the k-th value are
kept), top-p (`TopPLogitsWarper`: at least one token is kept), softmax.

Everything is batched over rows and device-agnostic: tensors are created on the
device of the inputs. Per-row parameters travel as `SamplingTensors`, whose host-side
row lists let the hot path skip unused transforms without a device sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.errors import InvalidArgumentError
from specdec.sampling.params import SamplingParams, independent_seed

#: Token ids per row: a list of lists, or an int tensor [n, L] padded with -1.
#: Ids outside [0, vocab) are ignored (so -1 is the padding value).
Context = Sequence[Sequence[int]] | torch.Tensor
#: A generator per row (None entries use torch's default RNG), ONE generator shared by
#: all rows, or None for torch's default RNG. Only per-row generators make a request's
#: draws independent of the batch it happens to share; the other two forms are for
#: large statistical batches and unseeded traffic.
Generators = Sequence[torch.Generator | None] | torch.Generator | None


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row `SamplingParams` as device tensors, built once per batch."""

    params: tuple[SamplingParams, ...]
    temperature: torch.Tensor  # [n] float32; greedy rows hold 1.0
    top_k: torch.Tensor  # [n] int64; 0 = off
    top_p_cutoff: torch.Tensor  # [n] float32; float32(1 - top_p) computed in double, as HF does
    repetition_penalty: torch.Tensor  # [n] float32
    greedy_rows: tuple[int, ...]
    top_k_rows: tuple[int, ...]  # sampling rows with top_k > 0
    top_p_rows: tuple[int, ...]  # sampling rows with top_p < 1
    penalty_rows: tuple[int, ...]  # rows (greedy included) with repetition_penalty != 1

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device | str) -> SamplingTensors:
        params = tuple(params)
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        return cls(
            params=params,
            temperature=torch.tensor(
                [1.0 if p.is_greedy else p.temperature for p in params], dtype=torch.float32, device=device
            ),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p_cutoff=torch.tensor([1.0 - p.top_p for p in params], dtype=torch.float32, device=device),
            repetition_penalty=torch.tensor(
                [p.repetition_penalty for p in params], dtype=torch.float32, device=device
            ),
            greedy_rows=tuple(i for i, p in enumerate(params) if p.is_greedy),
            top_k_rows=tuple(i for i in sampled if params[i].top_k > 0),
            top_p_rows=tuple(i for i in sampled if params[i].top_p < 1.0),
            penalty_rows=tuple(i for i, p in enumerate(params) if p.repetition_penalty != 1.0),
        )

    def __len__(self) -> int:
        return len(self.params)

    def repeat_interleave(self, times: int) -> SamplingTensors:
        """Each row repeated `times` times in place (row r → rows r*times .. r*times+times-1)."""
        return SamplingTensors.from_params(
            [p for p in self.params for _ in range(times)], self.temperature.device
        )


def _as_tensors(
    params: Sequence[SamplingParams] | SamplingTensors, n: int, device: torch.device
) -> SamplingTensors:
    st = params if isinstance(params, SamplingTensors) else SamplingTensors.from_params(params, device)
    if len(st) != n:
        raise InvalidArgumentError(f"params: got {len(st)} rows for {n} logit rows")
    return st


def _pad_ids(ids: Context, device: torch.device) -> torch.Tensor:
    """Context as an int64 tensor [n, L] padded with -1."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 2:
            raise InvalidArgumentError(f"context: expected a 2-D tensor, got shape {tuple(ids.shape)}")
        return ids.to(device=device, dtype=torch.int64)
    width = max((len(row) for row in ids), default=0)
    padded = [list(row) + [-1] * (width - len(row)) for row in ids]
    return torch.tensor(padded, dtype=torch.int64, device=device).view(len(padded), width)


def _context_mask(context: Context, n: int, vocab: int, device: torch.device) -> torch.Tensor:
    """[n, vocab + 1] bool: True where the token id occurs in the row's context.

    The extra last column absorbs padding / out-of-vocab ids; callers drop it.
    """
    ids = _pad_ids(context, device)  # [n, L]
    if ids.shape[0] != n:
        raise InvalidArgumentError(f"context: got {ids.shape[0]} rows for {n} logit rows")
    ids = torch.where((ids >= 0) & (ids < vocab), ids, vocab)  # [n, L]
    mask = torch.zeros(n, vocab + 1, dtype=torch.bool, device=device)  # [n, vocab+1]
    return mask.scatter_(1, ids, True)


def _per_row(value: torch.Tensor | Sequence[float] | float, n: int, device: torch.device) -> torch.Tensor:
    """A float32 [n] tensor from a scalar, a sequence or a tensor."""
    if isinstance(value, torch.Tensor):
        out = value.to(device=device, dtype=torch.float32).reshape(-1)
        return out.expand(n) if out.numel() == 1 else out
    if isinstance(value, (int, float)):
        return torch.full((n,), float(value), dtype=torch.float32, device=device)
    return torch.tensor([float(v) for v in value], dtype=torch.float32, device=device)


def _penalize(logits: torch.Tensor, mask: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """CTRL penalty where `mask`: positive logits divided, negative multiplied (float32 math)."""
    x = logits.float()
    penalized = torch.where(x < 0, x * penalty, x / penalty)
    return torch.where(mask, penalized, x).to(logits.dtype)


def apply_repetition_penalty(
    logits: torch.Tensor,  # [n, vocab]
    context: Context,
    penalty: torch.Tensor | Sequence[float] | float,  # [n] or scalar
) -> torch.Tensor:
    """`transformers.RepetitionPenaltyLogitsProcessor` per row: for every token id in the
    row's context, a positive logit is divided by the penalty and a negative one multiplied.
    Returns new logits [n, vocab] of the input dtype."""
    n, vocab = logits.shape
    mask = _context_mask(context, n, vocab, logits.device)[:, :vocab]  # [n, vocab]
    pen = _per_row(penalty, n, logits.device)[:, None]  # [n, 1]
    return _penalize(logits, mask, pen)


def chunk_apply_repetition_penalty(
    logits: torch.Tensor,  # [batch, T, vocab]
    prior_context: Context | None,
    chunk_tokens: Context | None,  # [batch, >= T-1], padded with -1
    penalty: torch.Tensor | Sequence[float] | float,  # [batch] or scalar
) -> torch.Tensor:
    """Repetition penalty over a chunk whose context grows position by position.

    Position t (whose logits predict `chunk_tokens[:, t]`) sees the context
    `prior_context + chunk_tokens[:, :t]`. For verification, `prior_context` is the
    sequence up to and including the last committed token and `chunk_tokens` the draft
    tokens t1..tK (position K, the bonus position, sees all of them).
    """
    batch, t_len, vocab = logits.shape
    device = logits.device
    empty: list[list[int]] = [[] for _ in range(batch)]
    current = _context_mask(prior_context if prior_context is not None else empty, batch, vocab, device)
    chunk = _pad_ids(chunk_tokens if chunk_tokens is not None else empty, device)  # [batch, L]
    if chunk.shape[0] != batch:
        raise InvalidArgumentError(f"chunk_tokens: got {chunk.shape[0]} rows for {batch} logit rows")
    chunk = torch.where((chunk >= 0) & (chunk < vocab), chunk, vocab)  # [batch, L]
    masks = [current]  # [batch, vocab+1] per position
    for t in range(1, t_len):
        if t - 1 < chunk.shape[1]:
            current = current.scatter(1, chunk[:, t - 1 : t], True)  # [batch, vocab+1]
        masks.append(current)
    mask = torch.stack(masks, dim=1)[..., :vocab]  # [batch, T, vocab]
    pen = _per_row(penalty, batch, device)[:, None, None]  # [batch, 1, 1]
    return _penalize(logits, mask, pen)


def _top_k(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """`TopKLogitsWarper` on the rows in `st.top_k_rows` of float32 logits [n, vocab]."""
    vocab = logits.shape[-1]
    idx = torch.tensor(st.top_k_rows, dtype=torch.int64, device=logits.device)  # [m]
    sub = logits.index_select(0, idx)  # [m, vocab]
    k = st.top_k.index_select(0, idx).clamp(max=vocab)  # [m]
    k_max = min(max(st.params[i].top_k for i in st.top_k_rows), vocab)
    kth = torch.topk(sub, k_max).values.gather(1, (k - 1)[:, None])  # [m, 1]
    sub = sub.masked_fill(sub < kth, float("-inf"))  # [m, vocab]
    return logits.index_copy(0, idx, sub)


def _top_p(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """`TopPLogitsWarper` (min_tokens_to_keep=1) on the rows in `st.top_p_rows`."""
    idx = torch.tensor(st.top_p_rows, dtype=torch.int64, device=logits.device)  # [m]
    sub = logits.index_select(0, idx)  # [m, vocab]
    sorted_logits, sorted_idx = torch.sort(sub, descending=False)  # [m, vocab] each
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [m, vocab]
    remove = cumulative <= st.top_p_cutoff.index_select(0, idx)[:, None]  # [m, vocab]
    remove[..., -1:] = False  # the most likely token always survives
    remove = remove.scatter(1, sorted_idx, remove)  # [m, vocab] back in vocab order
    return logits.index_copy(0, idx, sub.masked_fill(remove, float("-inf")))


def logits_to_probs(
    logits: torch.Tensor,  # [n, vocab]
    params: Sequence[SamplingParams] | SamplingTensors,
    context: Context | None = None,
) -> torch.Tensor:
    """Next-token distributions [n, vocab] float32 for each row's sampling params.

    Applies the repetition penalty over `context` (pass None when the logits are already
    penalized, e.g. by `chunk_apply_repetition_penalty`), then temperature, top-k, top-p,
    softmax. Greedy rows (temperature 0) give a one-hot at the argmax of the (penalized)
    logits: the rejection sampler then reproduces greedy decoding exactly (accept iff the
    draft token is the argmax, recover / bonus = argmax), so mixed batches can go through
    one path; `rejection_sampler.greedy_accept` is the dedicated, draw-free greedy path.
    """
    n, vocab = logits.shape
    st = _as_tensors(params, n, logits.device)
    x = logits.float()  # [n, vocab]
    if context is not None and st.penalty_rows:
        x = apply_repetition_penalty(x, context, st.repetition_penalty)
    x = x / st.temperature[:, None]  # [n, vocab]
    if st.top_k_rows:
        x = _top_k(x, st)
    if st.top_p_rows:
        x = _top_p(x, st)
    probs = torch.softmax(x, dim=-1)  # [n, vocab]
    if st.greedy_rows:
        idx = torch.tensor(st.greedy_rows, dtype=torch.int64, device=logits.device)  # [g]
        best = x.index_select(0, idx).argmax(dim=-1, keepdim=True)  # [g, 1]
        one_hot = torch.zeros(len(st.greedy_rows), vocab, dtype=probs.dtype, device=probs.device)
        probs = probs.index_copy(0, idx, one_hot.scatter_(1, best, 1.0))
    return probs


def stack_chunks(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """Per-row chunks [T_b, vocab] zero-padded into the batch form the chunk functions take,
    [batch, width, vocab] (width >= every T_b)."""
    stacked = rows[0].new_zeros(len(rows), width, rows[0].shape[-1])
    for b, chunk in enumerate(rows):
        stacked[b, : chunk.shape[0]] = chunk
    return stacked


def chunk_logits_to_probs(
    logits: torch.Tensor,  # [batch, T, vocab]
    params: Sequence[SamplingParams] | SamplingTensors,  # one per batch row
    prior_context: Context | None = None,
    chunk_tokens: Context | None = None,  # [batch, >= T-1], padded with -1
) -> torch.Tensor:
    """`logits_to_probs` for T consecutive positions per row, where position t's
    repetition-penalty context is `prior_context + chunk_tokens[:, :t]` (see
    `chunk_apply_repetition_penalty`). Returns float32 [batch, T, vocab]."""
    batch, t_len, vocab = logits.shape
    st = _as_tensors(params, batch, logits.device)
    x = logits.float()  # [batch, T, vocab]
    if st.penalty_rows and (prior_context is not None or chunk_tokens is not None):
        x = chunk_apply_repetition_penalty(x, prior_context, chunk_tokens, st.repetition_penalty)
    probs = logits_to_probs(x.reshape(batch * t_len, vocab), st.repeat_interleave(t_len))
    return probs.view(batch, t_len, vocab)


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
            raise InvalidArgumentError(f"generators: got {len(generators)} for {n} rows")
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
