"""The planner's online correction of a service's cost table (`OnlineScale`)."""

from __future__ import annotations

import pytest

from specdec.cost_model import OnlineScale


def test_online_scale_corrects_a_bad_table_within_a_round() -> None:
    scale = OnlineScale(weight=0.1)
    assert scale.value == 1.0
    scale.observe(measured=0.01, predicted=0.04)  # a table timed four times too slow
    assert scale.value == pytest.approx(0.25)
    for measured in (0.012, 0.008, 0.01):
        scale.observe(measured=measured, predicted=0.04)
    assert scale.value == pytest.approx(0.25)  # a running mean over the first rounds
    scale.observe(measured=0.0, predicted=0.04)  # nothing measured: ignored
    assert scale.observed == 4
    for _ in range(200):
        scale.observe(measured=0.02, predicted=0.04)
    assert scale.value == pytest.approx(0.5, rel=1e-3)  # then an EMA that follows the machine
