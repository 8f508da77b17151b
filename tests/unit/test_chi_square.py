"""The torch chi-square test of tests/support gives scipy's p-values."""

from __future__ import annotations

import pytest
import torch

from tests.support.chi_square import chi_square_p_value


@pytest.mark.parametrize("shift", [0.0, 0.5, 3.0, 12.0])
def test_p_values_equal_scipys(shift: float) -> None:
    scipy_stats = pytest.importorskip("scipy.stats")
    expected = torch.tensor([40.0, 25.0, 20.0, 10.0, 5.0]) * 10
    observed = expected + torch.tensor([1.0, -1.0, 2.0, -2.5, 0.5]) * shift * 4
    ours = chi_square_p_value(observed, expected)
    theirs = float(scipy_stats.chisquare(observed.double().numpy(), expected.double().numpy()).pvalue)
    assert ours == pytest.approx(theirs, rel=1e-9, abs=1e-300)
