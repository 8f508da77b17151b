"""Adaptive speculation with traffic from the moment the gateway answers: a draft whose first
steps are slow (as while it loads compiled graphs) must not keep speculation off for good."""

from __future__ import annotations

import pytest

from specdec.model.runtime import ModelRuntime
from tests.support.services import slow_first
from tests.support.stacks import DRAFT_COSTS, TARGET_COSTS, StartStack, chat

QUESTION = "Explain in a few sentences how a lighthouse keeper spends a stormy night."
#: Requests sent one after another, at most: the first probe comes 32 plain rounds after
#: drafting stopped (or more, while its price exceeds its budget), and each request decodes
#: its 32 tokens in several plain rounds.
MAX_REQUESTS = 16


def resumed(drafted: list[int]) -> bool:
    """Drafting stopped for a request, and drafted in the last two."""
    return 0 in drafted and len(drafted) >= 2 and drafted[-1] > 0 and drafted[-2] > 0


def test_a_draft_slow_at_first_drafts_again(
    start_stack: StartStack, int8_runtime: ModelRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Costs are pinned (the draft a quarter of the target); the draft's first two Proposes take
    # two seconds more, far more than any target step (the first catches the draft up on the
    # prompt, the second is a step the planner learns from): priced by it, even a draft that is
    # always accepted would not pay, which no estimate of acceptance can change: only a probe can.
    stack = start_stack(int8_runtime, adaptive_k=True, target_costs=TARGET_COSTS, draft_costs=DRAFT_COSTS)
    try:
        assert stack.draft is not None
        slow_first(monkeypatch, stack.draft, "propose_together", 2.0, calls=2)
        drafted: list[int] = []
        with stack.client() as client:
            while len(drafted) < MAX_REQUESTS and not resumed(drafted):
                drafted.append(client.generate(chat(QUESTION), max_new_tokens=32).num_draft_tokens)
        assert drafted[0] > 0, drafted  # the first request drafts on the start-up costs,
        assert resumed(drafted), drafted  # the slow steps turn drafting off, and a probe turns it back on
    finally:
        start_stack.stop(stack)  # no later test shares it
