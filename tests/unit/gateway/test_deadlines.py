"""The gateway's call deadlines: a service still loading compiled graphs gets longer."""

from __future__ import annotations

import pytest

from specdec.cost_model import CostTable
from specdec.gateway.deadlines import GRAPH_LOAD_S, Deadlines
from tests.support.stacks import DRAFT_COSTS, TARGET_COSTS


def test_a_service_loading_compiled_graphs_gets_longer_until_it_is_done() -> None:
    steady = Deadlines(5.0, 20.0, CostTable(TARGET_COSTS), CostTable(DRAFT_COSTS))
    target_loading = steady.with_loading("target", True)
    assert target_loading.prefill(1, 100) == pytest.approx(steady.prefill(1, 100) + GRAPH_LOAD_S)
    assert target_loading.verify(4, 5) == pytest.approx(steady.verify(4, 5) + GRAPH_LOAD_S)
    assert target_loading.propose(4, 1, 4) == steady.propose(4, 1, 4)  # the draft is not loading
    both = target_loading.with_loading("draft", True)
    assert both.propose(4, 1, 4) == pytest.approx(steady.propose(4, 1, 4) + GRAPH_LOAD_S)
    assert both.control() == steady.control()  # no model work: no graph to wait for
    done = both.with_loading("target", False).with_loading("draft", False)
    assert done == steady
