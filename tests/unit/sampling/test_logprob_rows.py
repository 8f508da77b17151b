"""The logprob tensor work: raw and processed rows, the penalty context growing through the
draft tokens, top alternatives, and which entries a round's emitted tokens take."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import InvalidArgumentError
from specdec.sampling.logprobs import LogprobsOptions, LogprobsRequest, RowLogprobs, TokenLogprob, answer_rows
from specdec.sampling.params import SamplingParams
from specdec.sampling.transforms import logits_to_probs

VOCAB = 32


def _rows(seed: int, n: int, device: torch.device) -> torch.Tensor:
    return (torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3).to(device)  # [n, vocab]


@pytest.mark.device_agnostic
def test_raw_rows_are_the_log_softmax_with_sorted_alternatives(device: torch.device) -> None:
    rows = [_rows(0, 3, device), _rows(1, 1, device)]  # an item with K = 2 and a Decode step
    requests = [LogprobsRequest(top=4), LogprobsRequest(top=0)]
    drafted, answers = [[5, 7], []], [[1, 2, 3], [9]]
    out = answer_rows(rows, requests, [[1, 2], [3]], drafted, answers)
    want = torch.log_softmax(rows[0], dim=-1)  # [3, vocab]
    assert out[0].drafted == pytest.approx([want[0, 5].item(), want[1, 7].item()], abs=1e-6)
    assert out[0].answered == pytest.approx([want[i, t].item() for i, t in enumerate(answers[0])], abs=1e-6)
    for i, top in enumerate(out[0].top):
        assert [t for t, _ in top] == want[i].topk(4).indices.tolist()
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
    assert out[1].drafted == [] and out[1].top == [[]]
    assert out[1].answered == pytest.approx([torch.log_softmax(rows[1][0], dim=-1)[9].item()], abs=1e-6)


@pytest.mark.device_agnostic
def test_processed_rows_see_the_penalty_context_grow_through_the_draft(device: torch.device) -> None:
    params = SamplingParams(temperature=0.7, top_k=10, repetition_penalty=1.5)
    rows, prior, drafted = _rows(2, 3, device), [4, 6], [11, 12]
    out = answer_rows([rows], [LogprobsRequest(top=3, transforms=params)], [prior], [drafted], [[11, 12, 13]])[0]
    for i in range(3):
        want = logits_to_probs(rows[i : i + 1], [params], [prior + drafted[:i]])[0].log()  # [vocab]
        assert out.answered[i] == pytest.approx(want[[11, 12, 13][i]].item(), abs=1e-5)
        assert [t for t, _ in out.top[i]] == want.topk(3).indices.tolist()
    assert out.drafted == pytest.approx(out.answered[:2], abs=1e-6)


def test_a_greedy_requests_processed_distribution_is_its_transforms_at_temperature_one() -> None:
    greedy = SamplingParams(temperature=0.0, top_k=5, repetition_penalty=1.2, seed=3)
    assert LogprobsOptions(2).request_for(greedy) == LogprobsRequest(2)
    assert LogprobsOptions(2, processed=True).request_for(greedy) == LogprobsRequest(
        2, SamplingParams(temperature=1.0, top_k=5, repetition_penalty=1.2))
    sampled = SamplingParams(temperature=0.5, seed=3)
    assert LogprobsOptions(0, processed=True).request_for(sampled).transforms == SamplingParams(temperature=0.5)


@pytest.mark.parametrize("top", [-1, 21])
def test_top_outside_zero_to_twenty_names_the_field(top: int) -> None:
    with pytest.raises(InvalidArgumentError, match="logprobs.top_logprobs"):
        LogprobsOptions(top)


def test_emitted_tokens_take_drafted_entries_then_the_answer() -> None:
    rows = RowLogprobs(drafted=[-0.1, -0.2, -0.3], answered=[-1.0, -2.0, -3.0, -4.0],
                       top=[[(i, -0.5)] for i in range(4)])
    assert rows.emitted([7, 8, 9], 2) == [TokenLogprob(7, -0.1, ((0, -0.5),)), TokenLogprob(8, -0.2, ((1, -0.5),)),
                                          TokenLogprob(9, -3.0, ((2, -0.5),))]
    assert [t.logprob for t in rows.emitted([5], 0)] == [-1.0]


@pytest.mark.device_agnostic
def test_a_batch_mixing_raw_and_processed_rows_answers_each_as_alone(device: torch.device) -> None:
    params = SamplingParams(temperature=0.5, top_p=0.8, repetition_penalty=1.3)
    rows = [_rows(3, 2, device), _rows(4, 1, device), _rows(5, 2, device)]
    requests = [LogprobsRequest(2, params), LogprobsRequest(2), LogprobsRequest(1, params)]
    args = ([[1, 2], [3], [4, 5]], [[7], [], [8]], [[7, 0], [1], [8, 9]])
    mixed = answer_rows(rows, requests, *args)
    alone = [answer_rows([r], [q], *([a[b]] for a in args))[0] for b, (r, q) in enumerate(zip(rows, requests))]
    for got, want in zip(mixed, alone):
        assert got.drafted == pytest.approx(want.drafted, abs=1e-6)
        assert got.answered == pytest.approx(want.answered, abs=1e-6)
        assert [[t for t, _ in row] for row in got.top] == [[t for t, _ in row] for row in want.top]
