"""Pearson's chi-square goodness-of-fit test in torch, so that the statistical tests of the
sampler run wherever torch does (the GPU machine has no scipy)."""

from __future__ import annotations

import torch


def chi_square_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """`scipy.stats.chisquare(observed, expected).pvalue`: P(X >= the statistic) for X
    chi-square distributed with cells - 1 degrees of freedom, which is the regularized upper
    incomplete gamma function Q(dof / 2, statistic / 2). Counts [cells], on any device."""
    observed, expected = observed.double().cpu(), expected.double().cpu()
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor((observed.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, statistic / 2))
