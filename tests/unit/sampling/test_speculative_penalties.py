"""Speculative sampling with logit bias, penalties and min-p on both q and p emits exactly p's
distribution, the penalties' context growing through the draft tokens inside a round.

Toy models whose raw logits depend on the previous token only; the transforms make each
next-token distribution depend on the whole history (which tokens the output holds, and
how often). The draft's q comes from `logits_to_probs` over its own growing context, the
target's p for a round from `chunk_logits_to_probs` (prior context + draft tokens), as the
services compute them. Reference: p(history) position by position, plain decoding.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from functools import cache

import pytest
import torch

from specdec.sampling.draws import sample
from specdec.sampling.params import SamplingParams
from specdec.sampling.rejection_sampler import (
    accept_candidates,
    acceptance_probs,
    draw_candidates,
    recovery_probs,
    token_probs,
)
from specdec.sampling.transforms import SamplingTensors, chunk_logits_to_probs, logits_to_probs
from tests.support.marginals import marginal_p_value

pytestmark = pytest.mark.device_agnostic
VOCAB = 4
PROMPT = (2, 0)
#: Every new transform on, the output counted from the prompt's end, as the gateway sets it.
PARAMS = SamplingParams(
    temperature=0.9, min_p=0.05, logit_bias=((1, 0.7), (3, -0.4)), repetition_penalty=1.2,
    presence_penalty=0.8, frequency_penalty=0.6, penalty_start=len(PROMPT),
)
P_VALUE_FLOOR = 1e-3
History = tuple[int, ...]


def toy_logits(seed: int) -> torch.Tensor:
    """Raw next-token logits after each token, [vocab, vocab] float32."""
    return torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)) * 1.5


TARGET, DRAFT = toy_logits(1), toy_logits(2)


def next_probs(logits: torch.Tensor, histories: list[History]) -> torch.Tensor:
    """Each history's next-token distribution [n, vocab] under `PARAMS`, plain decoding."""
    rows = logits[torch.tensor([h[-1] for h in histories])]  # [n, vocab]
    return logits_to_probs(rows, [PARAMS] * len(histories), [list(h) for h in histories])


def target_chunk(history: History, drafts: torch.Tensor, grow: bool = True) -> torch.Tensor:
    """p over a round [D, k+1, vocab] for D drafts [D, k] after `history`, as the target computes
    it; `grow=False` is the bug the test must catch: p ignoring the draft tokens."""
    prev = torch.cat([torch.full((drafts.shape[0], 1), history[-1]), drafts], dim=1)  # [D, k+1]
    chunk = drafts.tolist() if grow else None
    return chunk_logits_to_probs(TARGET[prev], [PARAMS] * drafts.shape[0], [list(history)] * drafts.shape[0], chunk)


def reference(n: int) -> dict[History, float]:
    """P(first n output tokens) under plain decoding with the target."""
    dist = {(): 1.0}
    for _ in range(n):
        grown: dict[History, float] = {}
        for seq, prob in dist.items():
            probs = next_probs(TARGET, [PROMPT + seq])[0].double()
            grown |= {seq + (t,): prob * float(probs[t]) for t in range(VOCAB) if probs[t] > 0}
        dist = grown
    return dist


def speculative(k: int, n: int, grow: bool = True) -> dict[History, float]:
    """Exact P(first n output tokens) of repeated rounds of k draft tokens, enumerating every
    draft and every accept / reject branch with the sampler's own probabilities."""

    @cache
    def round_outcomes(history: History) -> list[tuple[float, History]]:
        drafts = torch.tensor(list(itertools.product(range(VOCAB), repeat=k)))  # [D, k]
        q = torch.stack([next_probs(DRAFT, [history + tuple(d[:i]) for d in drafts.tolist()])
                         for i in range(k)], dim=1)  # [D, k, vocab]
        p = target_chunk(history, drafts, grow)  # [D, k+1, vocab]
        accept = acceptance_probs(token_probs(p, drafts), token_probs(q, drafts)).double()  # [D, k]
        outcomes = []
        for d, draft in enumerate(drafts.tolist()):
            reach = float(q[d].double().gather(-1, drafts[d][:, None]).prod())  # P(the draft proposes it)
            for i in range(k):
                recovered = recovery_probs(p[d, i][None], q[d, i][None])[0].double()  # [vocab]
                outcomes += [(reach * (1 - accept[d, i].item()) * recovered[x].item(), (*draft[:i], x))
                             for x in range(VOCAB)]
                reach *= accept[d, i].item()
            outcomes += [(reach * p[d, k, x].item(), (*draft, x)) for x in range(VOCAB)]  # bonus
        return [(prob, tuple(seq)) for prob, seq in outcomes if prob > 0]

    @cache
    def first(history: History, n: int) -> dict[History, float]:
        dist: dict[History, float] = defaultdict(float)
        for prob, seq in round_outcomes(history):
            if len(seq) >= n:
                dist[seq[:n]] += prob
            else:
                for tail, tail_prob in first(history + seq, n - len(seq)).items():
                    dist[seq + tail] += prob * tail_prob
        return dict(dist)

    return first(PROMPT, n)


@pytest.mark.parametrize(("k", "n"), [(1, 3), (2, 3), (3, 2)])
def test_exact_output_distribution_equals_plain_decoding(k: int, n: int) -> None:
    exact, want = speculative(k, n), reference(n)
    assert abs(sum(exact.values()) - 1.0) < 1e-6
    assert set(exact) <= set(want)
    for seq, prob in want.items():
        assert abs(exact.get(seq, 0.0) - prob) < 1e-6, seq


def test_a_target_that_ignores_the_draft_tokens_is_caught() -> None:
    """Power check: the penalties really move within a round here, so a p computed over the
    round's prior context alone would emit another distribution."""
    wrong, want = speculative(2, 3, grow=False), reference(3)
    assert max(abs(wrong.get(seq, 0.0) - prob) for seq, prob in want.items()) > 1e-3


def simulate(rows: int, k: int, n: int, seed: int, device: torch.device) -> list[History]:
    """First n output tokens of each of `rows` requests: rounds split as the services run them
    (q and the drafts on the draft, p and the candidates on the target, acceptance on the
    gateway), one shared generator per side."""
    gen, target_gen = torch.Generator(device).manual_seed(seed), torch.Generator(device).manual_seed(seed + 1)
    target, draft = TARGET.to(device), DRAFT.to(device)
    tensors = SamplingTensors.from_params([PARAMS] * rows, device)
    histories = [list(PROMPT) for _ in range(rows)]
    while min(len(h) for h in histories) < len(PROMPT) + n:
        drafted = torch.empty(rows, 0, dtype=torch.long, device=device)  # [rows, i]
        q = []
        for _ in range(k):
            last = drafted[:, -1] if drafted.shape[1] else torch.tensor([h[-1] for h in histories], device=device)
            context = [h + d for h, d in zip(histories, drafted.tolist())]
            q.append(logits_to_probs(draft[last], tensors, context))  # [rows, vocab]
            drafted = torch.cat([drafted, sample(q[-1], gen)[:, None]], dim=1)
        prev = torch.cat([torch.tensor([h[-1] for h in histories], device=device)[:, None], drafted], dim=1)
        p = chunk_logits_to_probs(target[prev], tensors, histories, drafted)  # [rows, k+1, vocab]
        q_rows = torch.stack(q + [torch.zeros_like(q[0])], dim=1)  # [rows, k+1, vocab], no q at the bonus
        candidates = draw_candidates(p.reshape(-1, VOCAB), q_rows.reshape(-1, VOCAB), target_gen).view(rows, k + 1)
        q_drafts = torch.stack(q, dim=1)  # [rows, k, vocab]
        result = accept_candidates(token_probs(p, drafted), token_probs(q_drafts, drafted), drafted, [k] * rows,
                                   candidates, gen)
        for history, new in zip(histories, result.token_lists()):
            history.extend(new)
    return [tuple(h[len(PROMPT) : len(PROMPT) + n]) for h in histories]


def test_chi_square_split_rounds_follow_plain_decoding(device: torch.device) -> None:
    n = 3
    want = reference(n)
    cell = {seq: i for i, seq in enumerate(want)}
    samples = simulate(rows=6_000, k=2, n=n, seed=77, device=device)
    assert set(samples) <= set(want), "emitted a sequence plain decoding cannot produce"
    p_value = marginal_p_value([cell[s] for s in samples], {cell[s]: prob for s, prob in want.items()})
    assert p_value > P_VALUE_FLOOR, p_value
