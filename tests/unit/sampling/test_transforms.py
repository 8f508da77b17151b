"""The sampling transforms against transformers' processors, and seeded sampling; on `--device`."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdec.errors import InvalidArgumentError
from specdec.sampling.draws import NO_TOKEN, check_drawn, drawn_tokens, make_generator, sample
from specdec.sampling.params import SamplingParams
from specdec.sampling.transforms import (
    SamplingTensors,
    apply_repetition_penalty,
    chunk_apply_repetition_penalty,
    chunk_logits_to_probs,
    logits_to_probs,
)
from tests.support.chi_square import chi_square_p_value
from tests.support.references import assert_matches_reference

pytestmark = pytest.mark.device_agnostic
VOCAB = 50


def _hf_probs(logits: torch.Tensor, params: SamplingParams, context: list[int]) -> torch.Tensor:
    """What `transformers.generate` computes for one row: processors as generate builds them."""
    processors = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.is_greedy:
        scores = processors(torch.tensor([context], dtype=torch.long, device=logits.device), logits[None])
        return torch.nn.functional.one_hot(scores.argmax(-1), logits.shape[-1]).float()[0]
    if params.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k != 0:
        processors.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        processors.append(TopPLogitsWarper(params.top_p))
    scores = processors(torch.tensor([context], dtype=torch.long, device=logits.device), logits[None])
    return scores.softmax(-1)[0]


def _random_case(seed: int, n: int, device: torch.device) -> tuple[torch.Tensor, list[SamplingParams], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    # Half the rows have integer logits, so top-k / top-p ties are exercised.
    logits = torch.randn(n, VOCAB, generator=g) * 3
    logits[::2] = torch.randint(-4, 5, (n - n // 2, VOCAB), generator=g).float()

    def pick(options: list) -> object:
        return options[int(torch.randint(len(options), (), generator=g))]

    params = [
        SamplingParams(
            temperature=pick([0.0, 0.3, 0.7, 1.0, 1.5]),
            top_k=pick([0, 0, 1, 3, 10, VOCAB, VOCAB + 7]),
            top_p=pick([1.0, 1.0, 0.05, 0.5, 0.9, 0.95]),
            repetition_penalty=pick([1.0, 1.0, 0.7, 1.3, 2.0]),
        )
        for _ in range(n)
    ]
    context = [
        torch.randint(0, VOCAB, (int(torch.randint(0, 12, (), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]
    return logits.to(device), params, context


@pytest.mark.parametrize("seed", range(12))
def test_logits_to_probs_matches_transformers(seed: int, device: torch.device) -> None:
    logits, params, context = _random_case(seed, n=16, device=device)
    ours = logits_to_probs(logits, params, context=context)  # [n, vocab]
    assert ours.dtype == torch.float32
    for row in range(len(params)):
        theirs = _hf_probs(logits[row], params[row], context[row])
        # Same ops in the same order: the same tokens cut, the same values (bit for bit on the CPU).
        assert_matches_reference(ours[row], theirs, (row, params[row]))


def test_repetition_penalty_matches_transformers_exactly(device: torch.device) -> None:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, VOCAB, generator=g) * 4).to(device)  # [6, vocab]
    context = [[1, 2, 2, 49], [], [0], [5, 7, 9, 11, 13], [3, VOCAB + 3], [49, 48, 1]]
    penalties = [1.2, 1.2, 0.5, 2.0, 1.7, 1.0]
    ours = apply_repetition_penalty(logits, context, penalties)
    for row, (ids, penalty) in enumerate(zip(context, penalties)):
        processor = RepetitionPenaltyLogitsProcessor(penalty)
        input_ids = torch.tensor([ids], dtype=torch.long, device=device).view(1, len(ids))
        theirs = processor(input_ids, logits[row : row + 1].clone())
        assert_matches_reference(ours[row], theirs[0], row)
    # The padded-tensor form of the context (pad -1) gives the same result.
    padded = torch.full((6, 5), -1, dtype=torch.long)
    for row, ids in enumerate(context):
        padded[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    penalty = torch.tensor(penalties, device=device)
    assert torch.equal(apply_repetition_penalty(logits, padded.to(device), penalty), ours)


def test_repetition_penalty_signs_and_scalar_penalty(device: torch.device) -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]], device=device)
    out = apply_repetition_penalty(logits, [[0, 1]], 2.0)
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0]]


def test_greedy_rows_are_one_hot_at_penalized_argmax(device: torch.device) -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.5]], device=device)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, repetition_penalty=2.0)]
    probs = logits_to_probs(logits, params, [[], [1]])
    assert probs.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]


def test_sampling_tensors_reusable_and_row_count_checked(device: torch.device) -> None:
    logits, params, context = _random_case(99, n=5, device=device)
    tensors = SamplingTensors.from_params(params, logits.device)
    assert torch.equal(logits_to_probs(logits, tensors, context), logits_to_probs(logits, params, context))
    with pytest.raises(InvalidArgumentError, match="params"):
        logits_to_probs(logits, params[:4])


@pytest.mark.parametrize("as_tensor", [False, True])
def test_chunk_helper_equals_position_by_position(as_tensor: bool, device: torch.device) -> None:
    g = torch.Generator().manual_seed(7)
    batch, t_len = 4, 5
    logits = (torch.randn(batch, t_len, VOCAB, generator=g) * 3).to(device)  # [batch, T, vocab]
    params = [
        SamplingParams(repetition_penalty=1.5, top_p=0.9),
        SamplingParams(temperature=0, repetition_penalty=3.0),
        SamplingParams(temperature=0.8, top_k=5, repetition_penalty=0.8),
        SamplingParams(),
    ]
    prior = [[1, 2, 3], [], [4], [5, 6]]
    # The chunk tokens are what each position emits: positions repeat earlier ones.
    chunk = [[7, 1, 7, 8], [2, 2, 9], [10, 11, 4, 10], [5]]
    if as_tensor:
        prior_arg = torch.tensor([[1, 2, 3], [-1, -1, -1], [4, -1, -1], [5, 6, -1]], device=device)
        chunk_arg = torch.tensor([[7, 1, 7, 8], [2, 2, 9, -1], [10, 11, 4, 10], [5, -1, -1, -1]], device=device)
    else:
        prior_arg, chunk_arg = prior, chunk
    ours = chunk_logits_to_probs(logits, params, prior_arg, chunk_arg)  # [batch, T, vocab]
    for t in range(t_len):
        context = [p + c[:t] for p, c in zip(prior, chunk)]
        expected = logits_to_probs(logits[:, t], params, context=context)  # [batch, vocab]
        torch.testing.assert_close(ours[:, t], expected, rtol=0, atol=0)
    penalties = [p.repetition_penalty for p in params]
    penalized = chunk_apply_repetition_penalty(logits, prior_arg, chunk_arg, penalties)  # [batch, T, vocab]
    for t in range(t_len):
        context = [p + c[:t] for p, c in zip(prior, chunk)]
        expected = apply_repetition_penalty(logits[:, t], context, penalties)
        assert torch.equal(penalized[:, t], expected)


def test_chunk_helper_without_context_is_plain_transform(device: torch.device) -> None:
    logits = torch.randn(2, 3, VOCAB, generator=torch.Generator().manual_seed(1)).to(device)
    params = [SamplingParams(top_k=4), SamplingParams(repetition_penalty=2.0)]
    ours = chunk_logits_to_probs(logits, params)  # [2, 3, vocab]
    expected = logits_to_probs(logits.reshape(6, VOCAB), [params[0]] * 3 + [params[1]] * 3)  # [6, vocab]
    assert torch.equal(ours, expected.view(2, 3, VOCAB))


def test_seeded_sampling_is_reproducible(device: torch.device) -> None:
    probs = torch.softmax(torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2)), -1).to(device)
    runs = []
    for _ in range(2):
        generators = [make_generator(seed, probs.device) for seed in (11, 12, 13)]
        runs.append(torch.stack([sample(probs, generators) for _ in range(20)]))
    assert torch.equal(runs[0], runs[1])
    assert runs[0].dtype == torch.int64 and runs[0].shape == (20, 3)


def test_seeded_sampling_independent_of_batch_composition(device: torch.device) -> None:
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(5, VOCAB, generator=g), -1).to(device)  # [5, vocab]
    alone_gen = [make_generator(42, device)]
    alone = [sample(probs[2:3], alone_gen).item() for _ in range(30)]
    batch_gens = [make_generator(s, probs.device) for s in (1, 2, 42, 4, 5)]
    batched = [sample(probs, batch_gens)[2].item() for _ in range(30)]
    assert alone == batched
    # Changing the neighbours (and their seeds) does not change row 2's draws.
    other = torch.softmax(torch.randn(5, VOCAB, generator=g), -1).to(device)
    other[2] = probs[2]
    other_gens = [make_generator(s, probs.device) for s in (7, None, 42, 9, None)]
    assert [sample(other, other_gens)[2].item() for _ in range(30)] == alone


def test_sample_shared_generator_and_default_rng(device: torch.device) -> None:
    probs = torch.softmax(torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(4)), -1).to(device)
    a = sample(probs, torch.Generator(device).manual_seed(5))
    b = sample(probs, torch.Generator(device).manual_seed(5))
    assert torch.equal(a, b) and a.shape == (4,)
    assert sample(probs, None).shape == (4,)
    assert sample(probs[:0], []).shape == (0,)
    with pytest.raises(InvalidArgumentError, match="generators"):
        sample(probs, [make_generator(1, device)])


def test_unseeded_generators_differ(device: torch.device) -> None:
    probs = torch.full((1, 1000), 1e-3, device=device)
    draws = {tuple(sample(probs.expand(8, -1), [make_generator(None, device)] * 8).tolist()) for _ in range(3)}
    assert len(draws) > 1


def test_sample_draws_each_token_with_its_share_of_the_weight(device: torch.device) -> None:
    weights = torch.tensor([3.0, 0.0, 1.0, 0.5, 0.0, 5.5])  # unnormalized, zeros included
    draws = sample(weights.to(device).expand(20_000, -1), torch.Generator(device).manual_seed(6)).cpu()
    observed = torch.bincount(draws, minlength=6).double()
    assert observed[1] == observed[4] == 0  # a zero weight is never drawn
    support = weights > 0
    expected = weights[support].double() / weights.sum() * draws.numel()
    assert chi_square_p_value(observed[support], expected) > 1e-4


def test_sample_at_the_top_of_the_unit_interval_stays_on_a_weighted_token(device: torch.device) -> None:
    from specdec.sampling.draws import _inverse_cdf

    weights = torch.tensor([[0.25, 0.75, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.1, 0.2, 0.0]], device=device)
    top = torch.full((3,), 1 - 2**-53, dtype=torch.float64, device=device)  # the largest uniform torch.rand gives
    assert _inverse_cdf(weights, top).tolist() == [1, 2, 2]
    assert _inverse_cdf(weights, torch.zeros(3, dtype=torch.float64, device=device)).tolist() == [0, 2, 1]


@pytest.mark.parametrize("bad", [0.0, float("nan"), float("inf"), -1.0])
def test_a_row_that_is_no_distribution_draws_no_token_and_is_refused_on_the_host(bad: float,
                                                                                 device: torch.device) -> None:
    weights = torch.full((3, 4), bad, device=device)
    weights[0] = 1.0  # good rows beside the bad one keep their draws
    weights[2] = torch.tensor([0.5, 0.0, 0.5, 0.0])
    if bad == -1.0:  # a negative weight beside positive ones, whose row sum is positive
        weights[1] = torch.tensor([0.5, -0.1, 0.6, 0.0])
    tokens = sample(weights, [make_generator(seed, device) for seed in range(3)])  # [3]
    host = tokens.tolist()
    assert host[1] == NO_TOKEN and 0 <= host[0] < 4 and host[2] in (0, 2)
    with pytest.raises(InvalidArgumentError, match="row 1 of 3 has no distribution to draw from"):
        drawn_tokens(tokens)
    assert drawn_tokens(tokens[[0, 2]]) == [host[0], host[2]]  # the device is fine: the next call works
    assert check_drawn([3, 1]) == [3, 1]
