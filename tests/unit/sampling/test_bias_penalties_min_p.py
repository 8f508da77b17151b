"""Logit bias, presence / frequency penalties and min-p against references; on `--device`.

min-p against `transformers`' `MinPLogitsWarper`; the bias and the output penalties (which
`transformers` lacks) against the formulas written out here: logit[t] + bias[t], and
logit[t] - (presence * (count[t] > 0) + frequency * count[t]) over the output tokens.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdec.errors import InvalidArgumentError
from specdec.sampling.params import SamplingParams
from specdec.sampling.transforms import (
    SamplingTensors,
    adjust_logits,
    chunk_adjust_logits,
    chunk_logits_to_probs,
    logits_to_probs,
)
from tests.support.references import assert_matches_reference

pytestmark = pytest.mark.device_agnostic
VOCAB = 40


def _reference_adjusted(logits: torch.Tensor, params: SamplingParams, context: list[int]) -> torch.Tensor:
    """Steps 1-3 for one row [vocab], each written from its definition."""
    scores = logits.float().clone()
    for token, bias in params.logit_bias:
        scores[token] += bias
    if params.repetition_penalty != 1.0:
        ids = torch.tensor([context], dtype=torch.long, device=logits.device).view(1, len(context))
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, scores[None])[0]
    counts = torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device)
    for token in context[params.penalty_start :]:
        counts[token] += 1
    presence = torch.tensor(params.presence_penalty, dtype=torch.float32, device=logits.device)
    frequency = torch.tensor(params.frequency_penalty, dtype=torch.float32, device=logits.device)
    return scores - (presence * (counts > 0) + frequency * counts)


def _reference_probs(logits: torch.Tensor, params: SamplingParams, context: list[int]) -> torch.Tensor:
    scores = _reference_adjusted(logits, params, context)[None]  # [1, vocab]
    if params.is_greedy:
        return torch.nn.functional.one_hot(scores.argmax(-1), logits.shape[-1]).float()[0]
    warpers = LogitsProcessorList()
    if params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k != 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0:
        warpers.append(MinPLogitsWarper(params.min_p))
    ids = torch.tensor([context], dtype=torch.long, device=logits.device).view(1, len(context))
    return warpers(ids, scores).softmax(-1)[0]


def _random_case(seed: int, n: int, device: torch.device) -> tuple[torch.Tensor, list[SamplingParams], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, VOCAB, generator=g) * 3
    logits[::2] = torch.randint(-4, 5, (n - n // 2, VOCAB), generator=g).float()  # ties for top-k / top-p / min-p

    def pick(options: list) -> object:
        return options[int(torch.randint(len(options), (), generator=g))]

    context = [torch.randint(0, VOCAB, (int(torch.randint(0, 14, (), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    params = [
        SamplingParams(
            temperature=pick([0.0, 0.5, 1.0, 1.7]),
            top_k=pick([0, 0, 5, VOCAB]),
            top_p=pick([1.0, 1.0, 0.6, 0.95]),
            repetition_penalty=pick([1.0, 1.0, 1.4]),
            min_p=pick([0.0, 0.0, 0.05, 0.3, 1.0]),
            logit_bias=pick([(), ((0, 5.0), (7, -100.0)), ((3, 0.25), (VOCAB - 1, 2.5))]),
            presence_penalty=pick([0.0, 0.0, 0.5, -1.0, 2.0]),
            frequency_penalty=pick([0.0, 0.0, 0.3, -0.7, 2.0]),
            penalty_start=min(len(row), pick([0, 2, 5, 100])),
        )
        for row in context
    ]
    return logits.to(device), params, context


@pytest.mark.parametrize("seed", range(8))
def test_logits_to_probs_matches_the_references(seed: int, device: torch.device) -> None:
    logits, params, context = _random_case(seed, n=16, device=device)
    ours = logits_to_probs(logits, params, context)  # [n, vocab]
    for row in range(len(params)):
        # Same ops in the same order: the same tokens cut, the same values (bit for bit on the CPU).
        reference = _reference_probs(logits[row], params[row], context[row])
        assert_matches_reference(ours[row], reference, params[row])
        # A row alone takes the path of a batch whose every row uses a transform.
        alone = logits_to_probs(logits[row : row + 1], [params[row]], [context[row]])[0]
        assert_matches_reference(alone, reference, params[row])


def test_min_p_matches_transformers_after_temperature(device: torch.device) -> None:
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, VOCAB, generator=g) * 2).to(device)  # [6, vocab]
    logits[5] = 1.0  # all tied: min_p = 1 keeps them all
    cases = [(0.1, 1.0), (0.1, 0.3), (0.5, 2.0), (1.0, 1.0), (0.02, 0.7), (1.0, 1.0)]
    params = [SamplingParams(min_p=min_p, temperature=t) for min_p, t in cases]
    ours = logits_to_probs(logits, params)
    for row, (min_p, t) in enumerate(cases):
        scores = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(t)(None, logits[row : row + 1].clone()))
        assert torch.equal(ours[row], scores.softmax(-1)[0])
    assert (ours[3] > 0).sum() == 1 and (ours[5] > 0).sum() == VOCAB


def test_output_penalties_count_only_from_the_start() -> None:
    logits = torch.zeros(1, 6)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, penalty_start=3)
    # Prompt [1, 1, 2] is not counted; the output [2, 4, 4, 4] is.
    adjusted = adjust_logits(logits, [params], [[1, 1, 2, 2, 4, 4, 4]])
    assert adjusted.tolist() == [[0.0, 0.0, -0.75, 0.0, -1.25, 0.0]]
    # The repetition penalty beside them still sees the whole context [1, 2 | 2].
    both = adjust_logits(torch.ones(1, 6), [SamplingParams(repetition_penalty=2.0, presence_penalty=0.5,
                                                           penalty_start=2)], [[1, 2, 2]])
    assert both.tolist() == [[1.0, 0.5, 0.0, 1.0, 1.0, 1.0]]


def test_logit_bias_moves_the_greedy_argmax_and_out_of_vocab_ids_are_refused(device: torch.device) -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0]], device=device)
    greedy = SamplingParams(temperature=0, logit_bias=((0, -100.0), (1, 1.5)))
    assert logits_to_probs(logits, [greedy]).tolist() == [[0.0, 1.0, 0.0]]
    banned = logits_to_probs(logits, [SamplingParams(logit_bias=((0, -100.0),))])
    assert banned[0, 0] < 1e-40
    with pytest.raises(InvalidArgumentError, match="logit_bias: token id 3 is outside the vocabulary"):
        logits_to_probs(logits, [SamplingParams(logit_bias=((3, 1.0),))])


def test_unused_transforms_have_no_rows() -> None:
    """The hot path skips a transform by its host-side row list: plain rows list none."""
    st = SamplingTensors.from_params([SamplingParams(), SamplingParams(temperature=0, top_k=3)], "cpu")
    assert st.bias_rows == st.count_rows == st.min_p_rows == ()
    st = SamplingTensors.from_params(
        [SamplingParams(temperature=0, min_p=0.5), SamplingParams(logit_bias=((1, 0.0),)),
         SamplingParams(temperature=0, frequency_penalty=1.0), SamplingParams(min_p=0.5, logit_bias=((1, 2.0),))],
        "cpu",
    )
    assert (st.bias_rows, st.count_rows, st.min_p_rows) == ((3,), (2,), (3,))  # greedy rows skip min-p


@pytest.mark.parametrize("as_tensor", [False, True])
def test_chunk_equals_position_by_position(as_tensor: bool, device: torch.device) -> None:
    """Position t sees prior + chunk[:t]: a draft token moves the penalties after it, counted
    only from `penalty_start` on (which may fall inside the chunk)."""
    g = torch.Generator().manual_seed(11)
    batch, t_len = 5, 5
    logits = (torch.randn(batch, t_len, VOCAB, generator=g) * 3).to(device)  # [batch, T, vocab]
    params = [
        SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, penalty_start=1, min_p=0.1),
        SamplingParams(temperature=0, frequency_penalty=2.0, logit_bias=((7, 1.0),), penalty_start=2),
        SamplingParams(temperature=0.8, presence_penalty=-0.5, repetition_penalty=1.3, penalty_start=3),
        SamplingParams(logit_bias=((2, -3.0), (5, 4.0)), top_k=6),
        SamplingParams(frequency_penalty=0.7, penalty_start=4),  # the output starts at chunk token 2
    ]
    prior = [[1, 7, 3], [], [4, 4, 4], [5, 6], [9, 8]]
    chunk = [[7, 1, 7, 7], [2, 2, 9], [10, 4, 4, 10], [5], [9, 9, 9, 8]]
    if as_tensor:
        width = 4
        prior_arg: object = torch.tensor([p + [-1] * (3 - len(p)) for p in prior], device=device)
        chunk_arg: object = torch.tensor([c + [-1] * (width - len(c)) for c in chunk], device=device)
    else:
        prior_arg, chunk_arg = prior, chunk
    probs = chunk_logits_to_probs(logits, params, prior_arg, chunk_arg)  # type: ignore[arg-type]
    adjusted = chunk_adjust_logits(logits, params, prior_arg, chunk_arg)  # type: ignore[arg-type]
    for t in range(t_len):
        context = [p + c[:t] for p, c in zip(prior, chunk)]
        assert torch.equal(probs[:, t], logits_to_probs(logits[:, t], params, context)), t
        assert torch.equal(adjusted[:, t], adjust_logits(logits[:, t], params, context)), t


def test_chunk_without_context_applies_the_bias_only(device: torch.device) -> None:
    logits = torch.randn(2, 3, VOCAB, generator=torch.Generator().manual_seed(1)).to(device)
    params = [SamplingParams(logit_bias=((4, 2.0),), presence_penalty=1.0), SamplingParams(frequency_penalty=2.0)]
    ours = chunk_logits_to_probs(logits, params)  # [2, 3, vocab]
    expected = logits_to_probs(logits.reshape(6, VOCAB), [params[0]] * 3 + [params[1]] * 3)  # [6, vocab]
    assert torch.equal(ours, expected.view(2, 3, VOCAB))
