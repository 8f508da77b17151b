"""Steps padded to bucketed shapes and replayed from CUDA graphs (`specdec.model.cuda_graphs`):
the same logits and cache as ordinary steps. On CUDA (`pytest --device cuda`) the graphs are
captured and replayed; on the CPU the same padded path runs eagerly."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.kv_cache.paged_cache import PagedKVCache
from specdec.model import cuda_graphs
from specdec.model.cuda_graphs import StepGraphs, round_up
from specdec.model.forward_batch import StepShape
from specdec.model.llama import PagedLlama

PROMPTS = {"a": [5, 9, 2, 33, 7, 1, 8], "b": list(range(40, 77)), "c": [3, 3, 4]}
BLOCK = 16


def _model(device: torch.device) -> PagedLlama:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
    )
    return PagedLlama(LlamaForCausalLM(config).to(device).eval())


def _prefilled(forward: PagedLlama) -> PagedKVCache:
    cache = forward.new_cache(token_budget=16 * BLOCK, block_size=BLOCK)
    for slot_id, prompt in PROMPTS.items():
        cache.blocks.allocate(slot_id)
        forward.run(cache, [(slot_id, prompt)])
    return cache


def _graphs(forward: PagedLlama, cache: PagedKVCache) -> StepGraphs:
    return StepGraphs(forward, cache, max_requests=4, max_tokens=5, max_blocks=8, capture=True)


def test_round_up_to_a_power_of_two_within_the_limit() -> None:
    assert [round_up(n, 16) for n in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert round_up(5, 6) == 6


def test_steps_take_the_bucket_of_their_size_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    forward = _model(torch.device("cpu"))
    graphs = _graphs(forward, _prefilled(forward))
    # "b" holds 37 tokens: 3 blocks, rounded up to 4; 3 requests round up to 4; 3 tokens to 4.
    assert graphs.shape_for([("a", [1]), ("b", [2, 3, 4]), ("c", [5])]) == StepShape(4, 4, 4)
    # A 1-token step of a 7-token context still gets the key positions of its masked layout.
    assert graphs.shape_for([("a", [1])]) == StepShape(1, 1, 1)
    assert graphs.shape_for([("a", [1] * 6)]) is None  # past max_tokens
    assert graphs.shape_for([(s, [1]) for s in "abcab"]) is None  # past max_requests
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPHS", 0)
    assert graphs.shape_for([("a", [1])]) is None  # no room for a new graph


@pytest.mark.device_agnostic
def test_padded_steps_give_the_ordinary_logits_and_cache(device: torch.device) -> None:
    forward = _model(device)
    ordinary, padded = _prefilled(forward), _prefilled(forward)
    graphs = _graphs(forward, padded)
    steps = [[("a", [11])], [("a", [12]), ("b", [13, 14, 15])], [("c", [16])], [("a", [17])],
             [("b", [18]), ("c", [19, 20, 21, 22])], [("a", [23])]]
    for chunks in steps:
        expected = forward.run(ordinary, chunks, logits="all", prompt=False)
        padded.blocks.append_many([(slot_id, len(tokens)) for slot_id, tokens in chunks])
        shape = graphs.shape_for(chunks)
        assert shape is not None
        got = forward.compute_fixed(padded, chunks, shape, graphs.run)
        for want, have in zip(expected, got):
            torch.testing.assert_close(have, want, rtol=0, atol=1e-4)
    assert len(graphs._steps) < len(steps)  # repeated shapes replayed their bucket
    for slot_id in PROMPTS:
        rows = torch.tensor(ordinary.blocks.positions(slot_id), device=device)
        for mine, theirs in zip(padded.kv, ordinary.kv):
            torch.testing.assert_close(mine.index_select(0, rows), theirs.index_select(0, rows), rtol=0, atol=1e-5)


class CompilesOneTokenSteps:
    """A layer runner standing in for compiled layers: 1-token steps are "compiled"."""

    def __init__(self, forward: PagedLlama) -> None:
        self.forward = forward

    def __call__(self, *args: object) -> torch.Tensor:
        return self.forward.eager_layers(*args)  # type: ignore[arg-type]

    def compiles(self, requests: int, width: int) -> bool:
        return width == 1


def test_installed_graphs_serve_the_steps_no_compiled_layer_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """`PagedLlama.step_graphs` serves `compute`'s steps (not prompts), as `compute_fixed` with the
    same logits, except the step shapes the layer runner compiles."""
    ordinary, replaying = _model(torch.device("cpu")), _model(torch.device("cpu"))  # the same weights
    ordinary_cache, cache = _prefilled(ordinary), _prefilled(replaying)
    graphs = _graphs(replaying, cache)
    replays: list[tuple[int, ...]] = []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda batch: replays.append(tuple(batch.input_ids.shape)) or run(batch))
    replaying.step_graphs = graphs

    def both(chunks: list[tuple[str, list[int]]], prompt: bool) -> None:
        want = ordinary.run(ordinary_cache, chunks, logits="all", prompt=prompt)
        got = replaying.run(cache, chunks, logits="all", prompt=prompt)
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-4)

    both([("a", [11, 12])], prompt=True)
    assert replays == []  # a prompt never replays
    both([("a", [13]), ("b", [14, 15, 16])], prompt=False)
    assert replays == [(2, 4)]
    replaying.layer_runner = CompilesOneTokenSteps(replaying)
    both([("c", [17])], prompt=False)
    assert replays == [(2, 4)]  # compiled: no replay
    both([("c", [18, 19])], prompt=False)
    assert replays == [(2, 4), (1, 2)]
