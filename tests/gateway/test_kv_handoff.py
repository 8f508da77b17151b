"""The gateway fills a self-draft's cache from the target's (`specdec.gateway.kv_handoff`),
through real services: the output stays plain decoding's, the draft never computes a
prompt, and a handoff that fails or is switched off leaves the draft to catch up by itself."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from specdec.errors import InvalidArgumentError
from specdec.gateway.kv_handoff import KVHandoff
from specdec.model.chat import encode_chat
from specdec.model.loader import LoadedModel
from specdec.model.runtime import ModelRuntime
from specdec.wire.items import ProposeItem
from specdec.wire.model_info import KVLayout, ModelInfo
from tests.support.fakes import model_info
from tests.support.stacks import Stack, StartStack, chat, generate_all

PROMPTS = ["Write a Python function that reverses a string.", "List three colours of the rainbow."]
MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def expected(target_model: LoadedModel, hf_greedy: Callable[[list[int], int], list[int]]) -> list[list[int]]:
    return [hf_greedy(encode_chat(target_model.tokenizer, chat(p)), MAX_NEW_TOKENS) for p in PROMPTS]


@pytest.fixture
def spied(monkeypatch: pytest.MonkeyPatch) -> Callable[[Stack], dict[str, list[Any]]]:
    """`spied(stack)`: the imports and Proposes its draft engine serves from now on."""

    def spy(stack: Stack) -> dict[str, list[Any]]:
        assert stack.draft is not None
        calls: dict[str, list[Any]] = {"imports": [], "proposes": []}
        import_kv, propose = stack.draft.import_kv, stack.draft.propose_together

        def counting_import(header: Any, kv: torch.Tensor) -> int:
            calls["imports"].append(header)
            return import_kv(header, kv)

        def counting_propose(merged: list[tuple[list[ProposeItem], Any]], *args: Any) -> Any:
            calls["proposes"].extend(item for items, _ in merged for item in items)
            return propose(merged, *args)

        monkeypatch.setattr(stack.draft, "import_kv", counting_import)
        monkeypatch.setattr(stack.draft, "propose_together", counting_propose)
        return calls

    return spy


@pytest.mark.parametrize("stack_name", ["int8_stack", "weak_stack"])
def test_the_target_fills_the_drafts_cache_and_the_output_is_plain_decodings(
    stack_name: str, expected: list[list[int]], spied: Callable[[Stack], dict[str, list[Any]]],
    request: pytest.FixtureRequest,
) -> None:
    """The int8 draft (the target's weights, bf16 cache) and the first-2-layer one (the
    target's first layers) both take the target's keys and values for each prompt."""
    stack = request.getfixturevalue(stack_name)
    calls = spied(stack)
    results = generate_all(stack, PROMPTS, MAX_NEW_TOKENS, num_speculative_tokens=4)
    assert [r.token_ids for r in results] == expected
    assert len(calls["imports"]) == len(PROMPTS)
    assert all(len(header.tokens) > 2 for header in calls["imports"])  # the prompt, less its last token
    assert max(len(item.new_tokens) for item in calls["proposes"]) <= 2  # never a prompt
    stack.wait_until_idle()


def test_without_the_handoff_the_draft_computes_the_prompt(
    start_stack: StartStack, weak_runtime: ModelRuntime, expected: list[list[int]],
    spied: Callable[[Stack], dict[str, list[Any]]],
) -> None:
    stack = start_stack(weak_runtime, kv_handoff=False)
    calls = spied(stack)
    results = generate_all(stack, PROMPTS, MAX_NEW_TOKENS, num_speculative_tokens=4)
    assert [r.token_ids for r in results] == expected
    assert not calls["imports"]
    assert max(len(item.new_tokens) for item in calls["proposes"]) > 2


@pytest.mark.parametrize("side", ["export", "import"])
def test_a_failed_handoff_leaves_the_draft_to_catch_up(
    side: str, weak_stack: Stack, expected: list[list[int]], monkeypatch: pytest.MonkeyPatch,
    spied: Callable[[Stack], dict[str, list[Any]]], caplog: pytest.LogCaptureFixture,
) -> None:
    """The target refuses the export, or the draft the import: the round goes on, the draft
    computes the prompt itself, and the output is plain decoding's."""
    calls = spied(weak_stack)

    def refuse(*args: Any) -> Any:
        raise InvalidArgumentError(f"no {side}s today")

    engine = weak_stack.target if side == "export" else weak_stack.draft
    monkeypatch.setattr(engine, f"{side}_kv", refuse)
    results = generate_all(weak_stack, PROMPTS, MAX_NEW_TOKENS, num_speculative_tokens=4)
    assert [r.token_ids for r in results] == expected
    assert max(len(item.new_tokens) for item in calls["proposes"]) > 2  # the prompt, computed by the draft
    assert "KV handoff" in caplog.text and f"no {side}s today" in caplog.text
    weak_stack.wait_until_idle()


def test_a_handoff_needs_the_same_weights_and_heads() -> None:
    """Only a draft whose keys and values the target computes takes them: the same weights
    and head shape, at most the target's layers, a dtype the wire carries."""
    layout = KVLayout("abc", 30, 3, 64)
    target = dataclasses.replace(model_info(), kv_layout=layout)

    def draft(**changes: Any) -> ModelInfo:
        return dataclasses.replace(model_info(), kv_layout=dataclasses.replace(layout, **changes))

    assert KVHandoff.between(target, draft()) == KVHandoff(30, torch.float32)
    assert KVHandoff.between(target, draft(num_layers=2)) == KVHandoff(2, torch.float32)
    assert KVHandoff.between(target, dataclasses.replace(draft(), dtype="bfloat16")) == KVHandoff(30, torch.bfloat16)
    for changes in ({"weights": "other"}, {"num_layers": 31}, {"num_kv_heads": 9}, {"head_dim": 32}):
        assert KVHandoff.between(target, draft(**changes)) is None, changes
    assert KVHandoff.between(target, None) is None
    assert KVHandoff.between(dataclasses.replace(target, kv_layout=KVLayout()), draft(weights="")) is None
