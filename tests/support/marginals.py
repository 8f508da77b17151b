"""Exact token marginals of a `transformers` model, for the sampling tests' chi-square checks."""

from __future__ import annotations

from collections import Counter

import torch
from transformers import PreTrainedModel

from tests.support.chi_square import chi_square_p_value


def second_token_marginal(model: PreTrainedModel, prompt: list[int], top_k: int) -> dict[int, float]:
    """P(t2) = Σ_t1 p(t1) p(t2 | t1) after `prompt`, sampling at temperature 1 with top-k `top_k`."""

    def top_k_probs(ids: list[int]) -> torch.Tensor:  # [vocab]
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        kth = logits.topk(top_k).values[-1]
        return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)

    first = top_k_probs(prompt)
    marginal: Counter[int] = Counter()
    for t1 in torch.nonzero(first).flatten().tolist():
        second = top_k_probs(prompt + [t1])
        for t2 in torch.nonzero(second).flatten().tolist():
            marginal[t2] += float(first[t1] * second[t2])
    return dict(marginal)


def marginal_p_value(samples: list[int], exact: dict[int, float]) -> float:
    """Chi-square p-value of sampled tokens against their exact distribution, the cells expected
    fewer than 5 times pooled into one; every sample must lie in the support."""
    counts = Counter(samples)
    assert set(counts) <= set(exact), f"sampled tokens outside the target's support: {set(counts) - set(exact)}"
    n = len(samples)
    common = sorted(t for t, p in exact.items() if p * n >= 5)
    observed = [counts[t] for t in common] + [n - sum(counts[t] for t in common)]
    expected = [exact[t] * n for t in common] + [n - sum(exact[t] * n for t in common)]
    if expected[-1] < 1e-9:
        observed, expected = observed[:-1], expected[:-1]
    return chi_square_p_value(*(torch.tensor(counted, dtype=torch.float64) for counted in (observed, expected)))
