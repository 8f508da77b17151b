"""The rejection sampler: deterministic cases, the greedy path, exactness and its statistics; on `--device`."""

from __future__ import annotations

import itertools
from collections import defaultdict
from functools import cache

import pytest
import torch

from specdec.errors import InvalidArgumentError
from specdec.sampling.draws import make_generator
from specdec.sampling.params import SamplingParams
from specdec.sampling.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    RejectionResult,
    accept_candidates,
    acceptance_probs,
    draw_candidates,
    greedy_accept,
    greedy_accept_argmax,
    recovery_probs,
    rejection_sample,
    token_probs,
)
from specdec.sampling.sparse_probs import SparseRows
from specdec.sampling.transforms import logits_to_probs
from tests.support.chi_square import chi_square_p_value

pytestmark = pytest.mark.device_agnostic
P_VALUE_FLOOR = 1e-3


def one_hot(token: int, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(token), vocab).float()


def random_probs(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    logits = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale
    return torch.softmax(logits, dim=-1)


# ---------------------------------------------------------------- deterministic cases


def test_perfect_match_accepts_all_and_adds_bonus(device: torch.device) -> None:
    vocab, k = 8, 3
    q = random_probs(2, k, vocab, seed=0)  # [2, k, vocab]
    p = torch.cat([q, torch.stack([one_hot(5, vocab), one_hot(2, vocab)])[:, None]], dim=1)  # [2, k+1, vocab]
    tokens = torch.tensor([[1, 2, 3], [7, 0, 4]])
    result = rejection_sample(p.to(device), q.to(device), tokens.to(device), [k, k],
                              [make_generator(1, device), make_generator(2, device)])
    assert result.token_lists() == [[1, 2, 3, 5], [7, 0, 4, 2]] and result.num_accepted.tolist() == [3, 3]


def test_early_mismatch_stops_with_recovered_token(device: torch.device) -> None:
    vocab = 6
    # Position 1: p(t1) >= q(t1) → always accepted. Position 2: p(t2) = 0 → always rejected;
    # the residual max(0, p2 - q2) is a one-hot at 4, so the recovered token is 4.
    q = torch.stack([random_probs(vocab, seed=1), one_hot(3, vocab), random_probs(vocab, seed=2)])[None]
    p2 = one_hot(4, vocab)
    p = torch.stack([q[0, 0], p2, random_probs(vocab, seed=3), random_probs(vocab, seed=4)])[None]
    p, q, tokens = p.to(device), q.to(device), torch.tensor([[2, 3, 1]], device=device)
    for seed in range(5):
        result = rejection_sample(p, q, tokens, [3], [make_generator(seed, device)])
        assert result.token_lists() == [[2, 4]] and result.num_accepted.tolist() == [1]


def test_rejected_first_token_never_reemits_it(device: torch.device) -> None:
    vocab = 4
    q = one_hot(0, vocab)[None, None].to(device)  # the draft is sure of 0 ...
    p = torch.stack([torch.tensor([0.5, 0.5, 0.0, 0.0]), random_probs(vocab, seed=0)])[None].to(device)  # target is not
    tokens = torch.tensor([[0]], device=device)
    outputs = [rejection_sample(p, q, tokens, [1], None).token_lists()[0] for _ in range(200)]
    assert {tuple(o) for o in outputs} <= {(0, 0), (0, 1), (0, 2), (0, 3), (1,)}
    assert any(o == [1] for o in outputs) and any(len(o) == 2 for o in outputs)


def test_per_request_k_including_zero_and_padding(device: torch.device) -> None:
    vocab, k_max = 5, 3
    p = random_probs(3, k_max + 1, vocab, seed=5)
    q = p[:, :k_max].clone()  # p == q: every real draft token is accepted
    p[0, 0] = one_hot(2, vocab)  # k=0 row: plain sampling from p_0
    p[1, 2] = one_hot(1, vocab)  # k=2 row: bonus from p_2
    q[1, 2] = 0.0  # padding garbage past k is ignored
    p[1, 3] = float("nan")
    tokens = torch.tensor([[-1, -1, -1], [4, 0, -1], [1, 1, 1]])
    result = rejection_sample(p.to(device), q.to(device), tokens.to(device), torch.tensor([0, 2, 3]),
                              torch.Generator(device).manual_seed(0))
    assert result.num_accepted.tolist() == [0, 2, 3]
    assert result.token_lists()[0] == [2]
    assert result.token_lists()[1] == [4, 0, 1]
    assert result.token_lists()[2][:3] == [1, 1, 1] and len(result.token_lists()[2]) == 4


def test_k_max_zero_batch_is_plain_sampling(device: torch.device) -> None:
    p = torch.stack([one_hot(3, 6), one_hot(1, 6)])[:, None].to(device)  # [2, 1, vocab]
    no_drafts = torch.empty(2, 0, dtype=torch.long, device=device)  # [2, 0]
    result = rejection_sample(p, torch.empty(2, 0, 6, device=device), no_drafts, [0, 0], None)
    assert result.token_lists() == [[3], [1]] and result.num_accepted.tolist() == [0, 0]


def test_seeded_rows_reproducible_and_independent_of_batch(device: torch.device) -> None:
    vocab = 6
    p = random_probs(4, 5, vocab, seed=6)  # [4, k_max+1, vocab], k_max = 4
    q = random_probs(4, 4, vocab, seed=7, scale=2.0)
    tokens = torch.multinomial(q.view(-1, vocab), 1, generator=torch.Generator().manual_seed(8)).view(4, 4)
    p, q, tokens = p.to(device), q.to(device), tokens.to(device)
    ks = [4, 0, 2, 3]
    seeds = [10, 11, 12, 13]

    def batched() -> list[list[list[int]]]:
        gens = [make_generator(s, device) for s in seeds]
        return [rejection_sample(p, q, tokens, ks, gens).token_lists() for _ in range(10)]

    first = batched()
    assert first == batched()
    assert len({tuple(map(tuple, r)) for r in first}) > 1  # the rounds do differ from each other
    for row, (k, seed) in enumerate(zip(ks, seeds)):
        gen = [make_generator(seed, device)]
        row_p, row_q, row_tokens = p[row : row + 1, : k + 1], q[row : row + 1, :k], tokens[row : row + 1, :k]
        alone = [
            rejection_sample(row_p, row_q, row_tokens, [k], gen).token_lists()[0]
            for _ in range(10)
        ]
        assert alone == [r[row] for r in first]


def test_shape_and_k_validation(device: torch.device) -> None:
    p, q = random_probs(2, 3, 5, seed=0).to(device), random_probs(2, 2, 5, seed=1).to(device)
    tokens = torch.zeros(2, 2, dtype=torch.long, device=device)
    with pytest.raises(InvalidArgumentError, match="num_draft_tokens"):
        rejection_sample(p, q, tokens, [3, 0])
    with pytest.raises(InvalidArgumentError, match="num_draft_tokens"):
        rejection_sample(p, q, tokens, [1])
    with pytest.raises(InvalidArgumentError, match="draft_probs"):
        rejection_sample(p, q[:, :1], tokens, [1, 1])
    with pytest.raises(InvalidArgumentError, match="draft_tokens"):
        greedy_accept(p, tokens[:, :1], [1, 1])
    with pytest.raises(InvalidArgumentError, match="generators"):
        rejection_sample(p, q, tokens, [1, 1], [make_generator(0, device)])


def test_recovery_falls_back_to_p_when_residual_is_zero(device: torch.device) -> None:
    p = random_probs(2, 5, seed=9).to(device)
    torch.testing.assert_close(recovery_probs(p, p), p)  # p itself, renormalized
    residual = recovery_probs(torch.tensor([[0.5, 0.5, 0.0]], device=device),
                              torch.tensor([[0.25, 0.75, 0.0]], device=device))
    assert residual.tolist() == [[1.0, 0.0, 0.0]]


# ---------------------------------------------------------------- greedy path


def test_greedy_accept_cases(device: torch.device) -> None:
    vocab = 7
    best = torch.tensor([[3, 1, 4, 1], [5, 2, 6, 0], [2, 2, 2, 2]])  # argmax per position
    logits = (torch.nn.functional.one_hot(best, vocab).float() * 3 + random_probs(3, 4, vocab, seed=0)).to(device)
    tokens = torch.tensor([[3, 1, 4], [5, 9, 6], [0, 0, 0]], device=device)
    result = greedy_accept(logits, tokens, [3, 3, 0])
    assert result.token_lists() == [[3, 1, 4, 1], [5, 2], [2]]  # all + bonus, mismatch at 2, k=0
    assert result.num_accepted.tolist() == [3, 1, 0]
    assert greedy_accept(logits, tokens, [2, 1, 0]).token_lists() == [[3, 1, 4], [5, 2], [2]]
    # The result is one padded batch: [B, K_max+1] tokens, placeholders past each row's output.
    placeholder = PLACEHOLDER_TOKEN_ID
    assert result.output_tokens.tolist() == [[3, 1, 4, 1], [5, 2, placeholder, placeholder],
                                             [2, placeholder, placeholder, placeholder]]
    assert tuple(result.num_accepted.shape) == (3,) and result.last_tokens().tolist() == [1, 2, 2]


def test_one_hot_greedy_probs_through_rejection_sampler_equal_greedy_accept(device: torch.device) -> None:
    vocab, k = 6, 3
    logits = torch.randn(16, k + 1, vocab, generator=torch.Generator().manual_seed(1))
    greedy = [SamplingParams(temperature=0)] * (16 * (k + 1))
    p = logits_to_probs(logits.view(-1, vocab), greedy).view(16, k + 1, vocab)
    q = random_probs(16, k, vocab, seed=2)
    tokens = torch.where(
        torch.rand(16, k, generator=torch.Generator().manual_seed(3)) < 0.6,
        logits[:, :k].argmax(-1),
        torch.multinomial(q.view(-1, vocab), 1, generator=torch.Generator().manual_seed(4)).view(16, k),
    )
    ks = [i % (k + 1) for i in range(16)]
    logits, p, q, tokens = logits.to(device), p.to(device), q.to(device), tokens.to(device)
    expected = greedy_accept(logits, tokens, ks)
    assert rejection_sample(p, q, tokens, ks, torch.Generator(device).manual_seed(5)).token_lists() == \
        expected.token_lists()


# ---------------------------------------------------------------- exactness
#
# Toy models with a Markov-1 context: the next-token distribution depends on the previous
# token only. P[a] is the target's distribution after token a, Q[a] the draft's.


def chain(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target P and (deliberately different) draft Q, both [vocab, vocab], float64."""
    p = random_probs(vocab, vocab, seed=seed, scale=0.8).double()
    q = random_probs(vocab, vocab, seed=seed + 100, scale=1.5).double()
    p[0, 1] = 0.0  # a hole in the target's support (as top-k / top-p make)
    q[2, 3] = 0.0  # and one in the draft's
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def exact_first_tokens(
    p_chain: torch.Tensor, q_chain: torch.Tensor, k: int, n: int
) -> dict[tuple[int, ...], float]:
    """Exact distribution of the first n emitted tokens of repeated speculative rounds
    from state 0, enumerating every draft and every accept / reject branch with the
    sampler's own `acceptance_probs` and `recovery_probs`."""
    vocab = p_chain.shape[0]

    @cache
    def round_outcomes(state: int) -> list[tuple[float, tuple[int, ...]]]:
        drafts = list(itertools.product(range(vocab), repeat=k))  # every possible t_1..t_k
        tokens = torch.tensor(drafts, dtype=torch.long).view(len(drafts), k)  # [D, k]
        prev = torch.cat([torch.full((len(drafts), 1), state), tokens], dim=1)  # [D, k+1] context of each p
        draft_probs = q_chain[prev[:, :k]].float()  # [D, k, V]
        target = p_chain[prev].float()  # [D, k+1, V]
        accept = acceptance_probs(token_probs(target, tokens), token_probs(draft_probs, tokens)).double()  # [D, k]
        outcomes = []  # (probability, emitted tokens) of every branch
        for d, draft in enumerate(drafts):
            # P(the draft proposes exactly `draft`), then times P(t_1..t_i all accepted).
            reach = float(torch.prod(draft_probs[d].double().gather(-1, tokens[d][:, None])))
            for i in range(k):
                rejected = reach * (1 - accept[d, i].item())
                recovered = recovery_probs(target[d, i][None], draft_probs[d, i][None])[0].double()  # [V]
                outcomes += [(rejected * recovered[x].item(), (*draft[:i], x)) for x in range(vocab)]
                reach *= accept[d, i].item()
            outcomes += [(reach * target[d, k, x].item(), (*draft, x)) for x in range(vocab)]  # bonus
        return outcomes

    @cache
    def first(state: int, n: int) -> dict[tuple[int, ...], float]:
        dist: dict[tuple[int, ...], float] = defaultdict(float)
        for prob, seq in round_outcomes(state):
            if len(seq) >= n:
                dist[seq[:n]] += prob
            else:
                for tail, tail_prob in first(seq[-1], n - len(seq)).items():
                    dist[seq + tail] += prob * tail_prob
        return dist

    return first(0, n)


def chain_prob(p_chain: torch.Tensor, seq: tuple[int, ...]) -> float:
    prob, state = 1.0, 0
    for token in seq:
        prob, state = prob * p_chain[state, token].item(), token
    return prob


@pytest.mark.parametrize(("vocab", "k", "n"), [(5, 1, 1), (5, 1, 3), (4, 2, 3), (4, 3, 2)])
def test_exact_output_distribution_equals_target(vocab: int, k: int, n: int) -> None:
    p_chain, q_chain = chain(vocab, seed=vocab + k)
    exact = exact_first_tokens(p_chain, q_chain, k, n)
    assert abs(sum(exact.values()) - 1.0) < 1e-6
    for seq in itertools.product(range(vocab), repeat=n):
        assert abs(exact.get(seq, 0.0) - chain_prob(p_chain, seq)) < 1e-6, seq


def simulate(
    p_chain: torch.Tensor,
    q_chain: torch.Tensor,
    rows: int,
    k_max: int,
    n: int,
    seed: int,
    device: torch.device,
    lie_about_q: bool = False,
    split: bool = False,
) -> torch.Tensor:
    """First n tokens [rows, n] of repeated speculative rounds, every row with a random k
    per round, all rows drawing from ONE shared generator (fast, deterministic). `split`
    runs the round as the services split it: the candidates drawn where p is, with a
    generator of their own, then `accept_candidates` with the shared one. On `device`."""
    p32, q32 = p_chain.float().to(device), q_chain.float().to(device)
    gen = torch.Generator(device).manual_seed(seed)
    target_gen = torch.Generator(device).manual_seed(seed + 1)
    emitted: list[list[int]] = [[] for _ in range(rows)]
    state = torch.zeros(rows, dtype=torch.long, device=device)  # [rows] last emitted token
    while min(len(e) for e in emitted) < n:
        ks = torch.randint(0, k_max + 1, (rows,), generator=gen, device=device)  # [rows]
        tokens = torch.empty(rows, k_max, dtype=torch.long, device=device)  # [rows, k_max]
        prev = state
        for i in range(k_max):
            tokens[:, i] = torch.multinomial(q32[prev], 1, generator=gen).squeeze(1)
            prev = tokens[:, i]
        prevs = torch.cat([state[:, None], tokens], dim=1)  # [rows, k_max+1]
        target = p32[prevs]  # [rows, k_max+1, V]
        draft = (p32 if lie_about_q else q32)[prevs[:, :k_max]]  # [rows, k_max, V]
        padding = torch.arange(k_max, device=device)[None] >= ks[:, None]  # [rows, k_max]
        tokens = tokens.masked_fill(padding, -1)
        result = (split_round(target, draft, tokens, ks, gen, target_gen) if split
                  else rejection_sample(target, draft, tokens, ks, gen))
        for row_emitted, new in zip(emitted, result.token_lists()):
            row_emitted.extend(new)
        state = result.last_tokens()
    return torch.tensor([e[:n] for e in emitted])


def split_round(
    target: torch.Tensor, draft: torch.Tensor, tokens: torch.Tensor, ks: torch.Tensor,
    gen: torch.Generator, target_gen: torch.Generator,
) -> RejectionResult:
    """One round as the target and the gateway run it: candidates (recovered at each draft
    position, bonus after the last) from `target_gen`, acceptance from `gen`."""
    rows, k_max = tokens.shape
    device = tokens.device
    valid = torch.arange(k_max, device=device)[None] < ks[:, None]  # [rows, k_max]
    drafted = torch.where(valid, tokens, 0)  # [rows, k_max]
    q = torch.cat([draft * valid[..., None], draft.new_zeros(rows, 1, draft.shape[-1])], dim=1)  # [rows, k_max+1, V]
    reached = torch.arange(k_max + 1, device=device)[None] <= ks[:, None]  # [rows, k_max+1]
    candidates = torch.full((rows, k_max + 1), -1, dtype=torch.long, device=device)
    candidates[reached] = draw_candidates(target[reached], q[reached], target_gen)
    return accept_candidates(token_probs(target, drafted), token_probs(draft, drafted), tokens, ks, candidates, gen)


def joint_p_value(samples: torch.Tensor, p_chain: torch.Tensor) -> float:
    vocab, n = p_chain.shape[0], samples.shape[1]
    cells = list(itertools.product(range(vocab), repeat=n))
    index = (samples * (vocab ** torch.arange(n - 1, -1, -1))).sum(1)  # [rows] base-V cell id
    observed = torch.bincount(index, minlength=len(cells)).double()
    expected = torch.tensor([chain_prob(p_chain, c) for c in cells], dtype=torch.float64) * samples.shape[0]
    support = expected > 0
    assert observed[~support].sum() == 0, "emitted a sequence the target cannot produce"
    assert expected[support].min() >= 5, "chi-square needs expected counts >= 5"
    return chi_square_p_value(observed[support], expected[support])


def test_chi_square_multi_token_outputs_follow_target(device: torch.device) -> None:
    p_chain, q_chain = chain(4, seed=21)
    samples = simulate(p_chain, q_chain, rows=20_000, k_max=3, n=3, seed=1234, device=device)  # joint of 3 tokens
    assert joint_p_value(samples, p_chain) > P_VALUE_FLOOR


def test_chi_square_split_round_follows_target(device: torch.device) -> None:
    """The round split between the services (candidates on the target with their own random
    stream, acceptance on the gateway) emits the target's joint distribution too."""
    p_chain, q_chain = chain(4, seed=22)
    samples = simulate(p_chain, q_chain, rows=20_000, k_max=3, n=3, seed=4321, device=device, split=True)
    assert joint_p_value(samples, p_chain) > P_VALUE_FLOOR


def test_chi_square_detects_a_wrong_q(device: torch.device) -> None:
    """Power check: telling the sampler the wrong q (here: q = p) makes the outputs follow
    the draft instead of the target, and the test above would catch it."""
    p_chain, q_chain = chain(4, seed=21)
    samples = simulate(p_chain, q_chain, rows=4_000, k_max=3, n=3, seed=1234, device=device, lie_about_q=True)
    assert joint_p_value(samples, p_chain) < 1e-12


def test_chi_square_bonus_and_per_row_generators(device: torch.device) -> None:
    """Per-row generators draw correctly too: all accepted (p == q), the bonus follows p_{k+1}."""
    vocab, rows, k = 5, 5_000, 2
    q = random_probs(vocab, seed=30).expand(rows, k, vocab).contiguous()  # [rows, k, V]
    bonus = random_probs(vocab, seed=31)
    target = torch.cat([q, bonus.expand(rows, 1, vocab)], dim=1)  # [rows, k+1, V]
    tokens = torch.multinomial(q[:, 0], k, replacement=True, generator=torch.Generator().manual_seed(32))
    gens = [make_generator(seed, device) for seed in range(rows)]
    result = rejection_sample(target.to(device), q.to(device), tokens.to(device), [k] * rows, gens)
    assert result.num_accepted.tolist() == [k] * rows
    counts = torch.bincount(torch.tensor([o[-1] for o in result.token_lists()]), minlength=vocab).double()
    assert chi_square_p_value(counts, bonus.double() * rows / bonus.double().sum()) > P_VALUE_FLOOR


def test_greedy_accept_from_argmax_tokens_equals_greedy_accept_from_logits(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 5, 7, generator=gen)  # [batch, k_max+1, vocab]
    best = logits.argmax(-1)  # [batch, k_max+1]
    # Draft tokens that agree with the target's argmax for a random prefix, then may not.
    tokens = torch.where(torch.rand(6, 4, generator=gen) < 0.7, best[:, :4], torch.randint(0, 7, (6, 4), generator=gen))
    ks = [4, 3, 0, 4, 1, 2]
    logits, best, tokens = logits.to(device), best.to(device), tokens.to(device)
    want = greedy_accept(logits, tokens, ks)
    for got in (greedy_accept_argmax(best, tokens, ks), greedy_accept_argmax(best.int(), tokens, ks)):  # int32: wire
        assert torch.equal(got.output_tokens, want.output_tokens) and torch.equal(got.num_accepted, want.num_accepted)


def test_a_bad_target_row_fails_the_round_with_a_clear_error(device: torch.device) -> None:
    """A position whose p is no distribution (NaN logits) raises on the host, where the tokens
    are copied, not on the device; the next round on the same device works."""
    p = random_probs(2, 3, 5, seed=40)  # [2, k_max+1, vocab]
    q = random_probs(2, 2, 5, seed=41)
    tokens = torch.tensor([[1, 2], [3, 4]])
    broken = p.clone()
    broken[1, 0] = float("nan")  # row 1's first position: its recovered token cannot be drawn
    with pytest.raises(InvalidArgumentError, match="no distribution to draw from"):
        rejection_sample(broken.to(device), q.to(device), tokens.to(device), [2, 2], [make_generator(0, device)] * 2)
    result = rejection_sample(p.to(device), q.to(device), tokens.to(device), [2, 2], [make_generator(0, device)] * 2)
    assert all(0 <= t < 5 for row in result.token_lists() for t in row)


# ---------------------------------------------------------------- deterministic drafts (lookups)
#
# A lookup proposes one token for sure: q is one-hot. Kept with probability p(t), on rejection
# drawn from p without t: the target's distribution again (docs/architecture.md#exactness-contract).


def lookup_chain(p_chain: torch.Tensor) -> torch.Tensor:
    """A deterministic draft [vocab, vocab]: after token a it proposes (a + 1) % vocab for sure,
    which after token 0 is a token the target never emits (p_chain[0, 1] == 0)."""
    vocab = p_chain.shape[0]
    return torch.nn.functional.one_hot((torch.arange(vocab) + 1) % vocab, vocab).double()


@pytest.mark.parametrize(("vocab", "k", "n"), [(5, 1, 2), (4, 2, 3), (4, 3, 2)])
def test_exact_output_distribution_with_a_one_hot_draft(vocab: int, k: int, n: int) -> None:
    p_chain, _ = chain(vocab, seed=vocab + k)
    exact = exact_first_tokens(p_chain, lookup_chain(p_chain), k, n)
    assert abs(sum(exact.values()) - 1.0) < 1e-6
    for seq in itertools.product(range(vocab), repeat=n):
        assert abs(exact.get(seq, 0.0) - chain_prob(p_chain, seq)) < 1e-6, seq


@pytest.mark.parametrize("split", [False, True], ids=["one-process", "split-round"])
def test_chi_square_one_hot_draft_follows_target(device: torch.device, split: bool) -> None:
    p_chain, _ = chain(4, seed=23)
    samples = simulate(p_chain, lookup_chain(p_chain), rows=20_000, k_max=3, n=3, seed=99, device=device, split=split)
    assert joint_p_value(samples, p_chain) > P_VALUE_FLOOR


def test_one_hot_sparse_rows_are_the_q_of_a_sure_draft() -> None:
    rows = SparseRows.one_hot([3, 0, 3])
    rows.check_drafted([3, 0, 3], vocab=5, field="q")
    dense = rows.distributions(5, extra_rows=1)  # [4, 5]: the bonus row has no q
    assert torch.equal(dense[:3], torch.nn.functional.one_hot(torch.tensor([3, 0, 3]), 5).float())
    assert dense[3].sum() == 0 and rows.probs_of([3, 0, 3]).tolist() == [1.0, 1.0, 1.0]
    assert rows.probs_of([3, 1, 3]).tolist() == [1.0, 0.0, 1.0]
