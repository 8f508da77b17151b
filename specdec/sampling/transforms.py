"""Logits → next-token distribution (the draws from it: `specdec.sampling.draws`).

The ONE implementation of the sampling transforms: the draft service uses it to get the
q it samples from, the target for p (sampled verification, plain decoding) and the
gateway for p from raw logits and first tokens. Exactness of speculative sampling rests
on both sides applying the same transforms, so there is no second copy anywhere.

Order, per row:
1. logit bias: added to the raw logits (OpenAI's `logit_bias`);
2. repetition penalty over the whole context (`RepetitionPenaltyLogitsProcessor`);
3. presence and frequency penalties over the output only, the context from the row's
   `penalty_start` on: logit[t] -= presence * (count[t] > 0) + frequency * count[t]
   (OpenAI's and vLLM's semantics);
4. temperature (`TemperatureLogitsWarper`);
5. top-k (`TopKLogitsWarper`: ties with the k-th value are kept);
6. top-p (`TopPLogitsWarper`: at least one token is kept);
7. min-p (`MinPLogitsWarper`: tokens below min_p x the top probability are dropped);
8. softmax.
Steps 1-3 ("adjustments") can move a greedy row's argmax; 4-7 never do, so a greedy row
is the one-hot at the argmax of its adjusted logits. Where `transformers` has the
processor, the result is bit-identical to it (tested).

Inside a verify the context grows position by position through the draft tokens: the
chunk functions give position t the context `prior + chunk[:t]`, for the repetition
penalty and the output counts alike, in one batched scatter per chunk.

Everything is batched over rows and device-agnostic: tensors are created on the
device of the inputs. Per-row parameters travel as `SamplingTensors`, whose host-side
row lists let the hot path skip unused transforms without a device sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.errors import InvalidArgumentError
from specdec.sampling.params import SamplingParams

#: Token ids per row: a list of lists, or an int tensor [n, L] padded with `PAD_ID` at the
#: end. Ids outside [0, vocab) are ignored.
Context = Sequence[Sequence[int]] | torch.Tensor
#: The padding of a `Context` tensor.
PAD_ID = -1


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
    bias_rows: tuple[int, ...]  # rows (greedy included) with a nonzero logit bias
    count_rows: tuple[int, ...]  # rows (greedy included) with a presence or frequency penalty
    min_p_rows: tuple[int, ...]  # sampling rows with min_p > 0

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
            bias_rows=tuple(i for i, p in enumerate(params) if p.uses_bias),
            count_rows=tuple(i for i, p in enumerate(params) if p.counts_output),
            min_p_rows=tuple(i for i in sampled if params[i].min_p > 0),
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
        raise InvalidArgumentError(f"params: got {len(st)} rows for {n} logit rows", field="params")
    return st


def _pad_ids(ids: Context, device: torch.device) -> torch.Tensor:
    """Context as an int64 tensor [n, L] padded with -1."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 2:
            raise InvalidArgumentError(f"context: expected a 2-D tensor, got shape {tuple(ids.shape)}", field="context")
        return ids.to(device=device, dtype=torch.int64)
    width = max((len(row) for row in ids), default=0)
    padded = [list(row) + [PAD_ID] * (width - len(row)) for row in ids]
    return torch.tensor(padded, dtype=torch.int64, device=device).view(len(padded), width)


def _in_vocab(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """`ids` with padding and out-of-vocab ids moved to the spare column `vocab`."""
    return torch.where((ids >= 0) & (ids < vocab), ids, vocab)


def _context_mask(context: Context, n: int, vocab: int, device: torch.device) -> torch.Tensor:
    """[n, vocab + 1] bool: True where the token id occurs in the row's context.

    The extra last column absorbs padding / out-of-vocab ids; callers drop it.
    """
    ids = _pad_ids(context, device)  # [n, L]
    if ids.shape[0] != n:
        raise InvalidArgumentError(f"context: got {ids.shape[0]} rows for {n} logit rows", field="context")
    mask = torch.zeros(n, vocab + 1, dtype=torch.bool, device=device)  # [n, vocab+1]
    return mask.scatter_(1, _in_vocab(ids, vocab), True)


def _chunk_ids(chunk_tokens: Context | None, batch: int, vocab: int, device: torch.device) -> torch.Tensor:
    """The chunk's tokens [batch, L], padding and out-of-vocab ids moved to the spare column."""
    chunk = _pad_ids(chunk_tokens if chunk_tokens is not None else [[] for _ in range(batch)], device)  # [batch, L]
    if chunk.shape[0] != batch:
        raise InvalidArgumentError(f"chunk_tokens: got {chunk.shape[0]} rows for {batch} logit rows",
                                   field="chunk_tokens")
    return _in_vocab(chunk, vocab)


def _grow_mask(mask: torch.Tensor, chunk: torch.Tensor, t_len: int) -> torch.Tensor:
    """Position t's copy of a per-row token mask [m, vocab+1] with chunk[:, :t] [m, L] marked:
    [m, T, vocab+1] in one scatter, the spare last column taking the tokens a position does
    not see yet."""
    width = chunk.shape[1]
    positions = torch.arange(t_len, device=chunk.device)  # [T]
    seen = torch.arange(width, device=chunk.device)[None, :] < positions[:, None]  # [T, L]: j < t
    index = torch.where(seen[None], chunk[:, None, :], mask.shape[-1] - 1)  # [m, T, L]
    return mask[:, None, :].repeat(1, t_len, 1).scatter_(2, index, True)


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
    prior = _context_mask(prior_context if prior_context is not None else [[]] * batch, batch, vocab, device)
    mask = _grow_mask(prior, _chunk_ids(chunk_tokens, batch, vocab, device), t_len)[..., :vocab]  # [batch, T, vocab]
    pen = _per_row(penalty, batch, device)[:, None, None]  # [batch, 1, 1]
    return _penalize(logits, mask, pen)


def _rows_of(context: Context, rows: tuple[int, ...], n: int) -> Context:
    """The context of `rows` only (of a context of n rows)."""
    count = context.shape[0] if isinstance(context, torch.Tensor) else len(context)
    if count != n:
        raise InvalidArgumentError(f"context: got {count} rows for {n} logit rows", field="context")
    if isinstance(context, torch.Tensor):
        return context.index_select(0, torch.tensor(rows, dtype=torch.int64, device=context.device))
    return [context[r] for r in rows]


def _output_counts(
    context: Context, starts: torch.Tensor, vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """How often each token occurs in each row's context from index starts[r] [m] on: float32
    counts [m, vocab+1] (the spare last column takes padding, out-of-vocab ids and the tokens
    before the start), and each context's length [m]."""
    padded = _pad_ids(context, device)  # [m, L]
    before = torch.arange(padded.shape[1], device=device)[None, :] < starts[:, None]  # [m, L]
    ids = _in_vocab(padded, vocab).masked_fill(before, vocab)  # [m, L]
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32, device=device)  # [m, vocab+1]
    counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=device))
    return counts, (padded != PAD_ID).sum(dim=1)


def _output_penalty(counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """presence * (count > 0) + frequency * count, elementwise (float32; broadcasts)."""
    return presence * (counts > 0) + frequency * counts


def _subtract_output_penalties(
    x: torch.Tensor, st: SamplingTensors, counts: torch.Tensor, chunk: torch.Tensor | None = None
) -> torch.Tensor:
    """logit -= `_output_penalty` on the rows in `st.count_rows` of float32 logits x [n, vocab],
    or x [n, T, vocab] with `chunk` [m, L]: the rows' counted chunk tokens (the spare id
    `vocab` where not counted), which position t adds to `counts` [m, vocab+1] for j < t.

    The chunk's tokens are the only columns whose count changes along the chunk: every
    position takes the prior's penalty, then those columns are rewritten with their count
    at each position, so the work beyond one pass over x is [m, T, L], not [m, T, vocab]."""
    rows, vocab = st.count_rows, x.shape[-1]
    device = x.device
    presence = torch.tensor([st.params[r].presence_penalty for r in rows], device=device)[:, None]  # [m, 1]
    frequency = torch.tensor([st.params[r].frequency_penalty for r in rows], device=device)[:, None]  # [m, 1]
    prior = _output_penalty(counts[:, :vocab], presence, frequency)  # [m, vocab]
    every_row = len(rows) == x.shape[0]  # rows are sorted and distinct: then they are all of x's, in order
    idx = torch.tensor(rows, dtype=torch.int64, device=device)  # [m]
    sub = x if every_row else x.index_select(0, idx)  # [m, vocab] or [m, T, vocab]
    if chunk is None:
        adjusted = sub - prior  # [m, vocab]
        return adjusted if every_row else x.index_copy(0, idx, adjusted)
    t_len, width = x.shape[1], chunk.shape[1]
    adjusted = sub - prior[:, None, :]  # [m, T, vocab]
    # Column j holds chunk token j (token 0 in place of the spare id: its own count then,
    # so a write to column 0 agrees with every other one).
    column = torch.where(chunk < vocab, chunk, 0)  # [m, L]
    earlier = torch.arange(width, device=device)[None, :] < torch.arange(t_len, device=device)[:, None]  # [T, L]
    matches = chunk[:, None, :] == column[:, :, None]  # [m, L (column j), L (chunk token i)]
    grown = (matches[:, None] & earlier[None, :, None, :]).sum(dim=-1)  # [m, T, L]: token j in chunk[:t]
    column_counts = counts.gather(1, column)[:, None, :] + grown  # [m, T, L]
    index = column[:, None, :].expand(-1, t_len, -1)  # [m, T, L]
    penalty = _output_penalty(column_counts, presence[..., None], frequency[..., None])  # [m, T, L]
    adjusted.scatter_(2, index, sub.gather(2, index) - penalty)
    return adjusted if every_row else x.index_copy(0, idx, adjusted)


def _add_bias(x: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Each row's logit bias added to float32 logits x [n, vocab], or to every position of
    x [n, T, vocab]: one copy of x and a write per biased token."""
    vocab = x.shape[-1]
    rows, ids, values = zip(*[(r, token, bias) for r in st.bias_rows for token, bias in st.params[r].logit_bias])
    if max(ids) >= vocab:
        raise InvalidArgumentError(f"logit_bias: token id {max(ids)} is outside the vocabulary [0, {vocab})",
                                   field="logit_bias")
    device = x.device
    row_index, id_index = torch.tensor(rows, device=device), torch.tensor(ids, device=device)  # [b] each
    bias = torch.tensor(values, dtype=torch.float32, device=device)  # [b]
    if x.dim() == 2:
        return x.index_put((row_index, id_index), bias, accumulate=True)
    positions = torch.arange(x.shape[1], device=device)[None, :]  # [1, T]
    return x.index_put((row_index[:, None], positions, id_index[:, None]), bias[:, None].expand(-1, x.shape[1]),
                       accumulate=True)


def _starts(st: SamplingTensors, device: torch.device) -> torch.Tensor:
    """`penalty_start` of the rows in `st.count_rows`, [m] int64."""
    return torch.tensor([st.params[r].penalty_start for r in st.count_rows], dtype=torch.int64, device=device)


def adjust_logits(
    logits: torch.Tensor,  # [n, vocab]
    params: Sequence[SamplingParams] | SamplingTensors,
    context: Context | None = None,
) -> torch.Tensor:
    """Steps 1-3 of the module docstring: logit bias, repetition penalty over `context`,
    presence and frequency penalties over its output part; float32 [n, vocab]. These are
    the transforms that can move a greedy row's argmax. No context: no tokens yet."""
    n, vocab = logits.shape
    st = _as_tensors(params, n, logits.device)
    x = logits.float()  # [n, vocab]
    if st.bias_rows:
        x = _add_bias(x, st)
    if context is not None and st.penalty_rows:
        x = apply_repetition_penalty(x, context, st.repetition_penalty)
    if context is not None and st.count_rows:
        counts, _ = _output_counts(_rows_of(context, st.count_rows, n), _starts(st, x.device), vocab, x.device)
        x = _subtract_output_penalties(x, st, counts)
    return x


def chunk_adjust_logits(
    logits: torch.Tensor,  # [batch, T, vocab]
    params: Sequence[SamplingParams] | SamplingTensors,  # one per batch row
    prior_context: Context | None = None,
    chunk_tokens: Context | None = None,  # [batch, >= T-1], padded with -1
) -> torch.Tensor:
    """`adjust_logits` for T consecutive positions per row, where position t's context is
    `prior_context + chunk_tokens[:, :t]` (see `chunk_apply_repetition_penalty`): a draft
    token moves the penalties of the positions after it. Float32 [batch, T, vocab]."""
    batch, t_len, vocab = logits.shape
    device = logits.device
    st = _as_tensors(params, batch, device)
    x = logits.float()  # [batch, T, vocab]
    if st.bias_rows:
        x = _add_bias(x, st)
    has_context = prior_context is not None or chunk_tokens is not None
    if st.penalty_rows and has_context:
        x = chunk_apply_repetition_penalty(x, prior_context, chunk_tokens, st.repetition_penalty)
    if st.count_rows and has_context:
        rows = st.count_rows
        prior = _rows_of(prior_context if prior_context is not None else [[]] * batch, rows, batch)
        chunk = _chunk_ids(chunk_tokens, batch, vocab, device).index_select(
            0, torch.tensor(rows, dtype=torch.int64, device=device))  # [m, L]
        starts = _starts(st, device)  # [m]
        counts, prior_len = _output_counts(prior, starts, vocab, device)  # [m, vocab+1], [m]
        # Chunk token j sits at index prior_len + j of the sequence: counted from the start on.
        index = prior_len[:, None] + torch.arange(chunk.shape[1], device=device)[None, :]  # [m, L]
        chunk = chunk.masked_fill(index < starts[:, None], vocab)  # [m, L]
        x = _subtract_output_penalties(x, st, counts, chunk)
    return x


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


def _min_p(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """`MinPLogitsWarper` (min_tokens_to_keep=1) on the rows in `st.min_p_rows`: a token whose
    probability is below min_p x the row's top probability is dropped (never the top one)."""
    every_row = len(st.min_p_rows) == logits.shape[0]
    idx = torch.tensor(st.min_p_rows, dtype=torch.int64, device=logits.device)  # [m]
    sub = logits if every_row else logits.index_select(0, idx)  # [m, vocab]
    probs = sub.softmax(dim=-1)  # [m, vocab]
    min_p = torch.tensor([st.params[r].min_p for r in st.min_p_rows], device=logits.device)[:, None]  # [m, 1]
    kept = sub.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))  # [m, vocab]
    return kept if every_row else logits.index_copy(0, idx, kept)


def _warp(x: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Steps 4-8 on adjusted float32 logits [n, vocab]: temperature, top-k, top-p, min-p,
    softmax; a greedy row becomes the one-hot at its argmax."""
    n, vocab = x.shape
    x = x / st.temperature[:, None]  # [n, vocab]
    if st.top_k_rows:
        x = _top_k(x, st)
    if st.top_p_rows:
        x = _top_p(x, st)
    if st.min_p_rows:
        x = _min_p(x, st)
    probs = torch.softmax(x, dim=-1)  # [n, vocab]
    if st.greedy_rows:
        idx = torch.tensor(st.greedy_rows, dtype=torch.int64, device=x.device)  # [g]
        best = x.index_select(0, idx).argmax(dim=-1, keepdim=True)  # [g, 1]
        one_hot = torch.zeros(len(st.greedy_rows), vocab, dtype=probs.dtype, device=probs.device)
        probs = probs.index_copy(0, idx, one_hot.scatter_(1, best, 1.0))
    return probs


def logits_to_probs(
    logits: torch.Tensor,  # [n, vocab]
    params: Sequence[SamplingParams] | SamplingTensors,
    context: Context | None = None,
) -> torch.Tensor:
    """Next-token distributions [n, vocab] float32 for each row's sampling params.

    All the transforms of the module docstring in order, the penalties over `context`
    (None: no tokens yet). Greedy rows (temperature 0) give a one-hot at the argmax of the
    adjusted logits: the rejection sampler then reproduces greedy decoding exactly (accept
    iff the draft token is the argmax, recover / bonus = argmax), so mixed batches can go
    through one path; `rejection_sampler.greedy_accept` is the dedicated, draw-free greedy path.
    """
    st = _as_tensors(params, logits.shape[0], logits.device)
    return _warp(adjust_logits(logits, st, context), st)


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
    penalty context is `prior_context + chunk_tokens[:, :t]` (see `chunk_adjust_logits`).
    Returns float32 [batch, T, vocab]."""
    batch, t_len, vocab = logits.shape
    st = _as_tensors(params, batch, logits.device)
    x = chunk_adjust_logits(logits, st, prior_context, chunk_tokens)  # [batch, T, vocab]
    probs = _warp(x.reshape(batch * t_len, vocab), st.repeat_interleave(t_len))
    return probs.view(batch, t_len, vocab)
