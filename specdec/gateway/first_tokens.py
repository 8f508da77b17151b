"""The token each newly prefilled request emits first, drawn at the gateway from the Prefill's
last-position logits: a request's first completion token, or, for one resuming after a
preemption, the token after those it has. It belongs to admission, not to a round: no draft is
judged, and the scheduler decides it between the Prefill and the request's first round.
"""

from __future__ import annotations

import torch

from specdec.gateway.acceptance import masked
from specdec.gateway.grammar.rounds import first_masks
from specdec.gateway.request import Request
from specdec.gateway.token_logprobs import first_logprobs
from specdec.sampling.draws import drawn_tokens, position_generator, sample
from specdec.sampling.logprobs import TokenLogprob
from specdec.sampling.token_masks import TokenMasks
from specdec.sampling.transforms import logits_to_probs


def first_tokens(seqs: list[Request], logits: dict[str, torch.Tensor],
                 masks: dict[str, TokenMasks] | None = None) -> dict[str, int]:
    """The next token of each newly prefilled sequence, from its last-position logits [vocab]
    (under its grammar's one-row `masks`, if it has one). The penalty context of a resumed
    request is all its tokens."""
    masks = masks or {}
    out = {}
    for seq in seqs:
        row = masked(logits[seq.slot_id][None], masks.get(seq.slot_id))  # [1, vocab]
        probs = logits_to_probs(row, [seq.sampling], [seq.tokens])  # [1, vocab]
        if seq.sampling.is_greedy:
            out[seq.slot_id] = int(probs.argmax())
            continue
        # A seeded request's token at this position is the draw plain decoding makes there.
        position = position_generator(seq.target_sampling, len(seq.tokens), "cpu")
        out[seq.slot_id] = drawn_tokens(sample(probs, [position or seq.generator]))[0]
    return out


def first_tokens_and_logprobs(
    seqs: list[Request], logits: dict[str, torch.Tensor]
) -> tuple[dict[str, int], dict[str, list[TokenLogprob]]]:
    """`first_tokens` under each structured-output request's grammar, and the logprobs of the
    tokens for the requests that ask. Tensor work: the scheduler runs it on its sampler thread."""
    masks = first_masks(seqs) if any(s.grammar is not None for s in seqs) else {}
    firsts = first_tokens(seqs, logits, masks)
    logprobs = first_logprobs(seqs, logits, firsts, masks) if any(s.logprobs is not None for s in seqs) else {}
    return firsts, logprobs
