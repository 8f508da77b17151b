"""A lookup's guess fed to the draft: the proposal is the draft's own whatever the guess, and
every guessed token it keeps saves a forward; and a draft that draws a stop token stops there.
In process on the fp32 model, so proposals compare bit for bit (greedy) or to rounding (q rows)."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from specdec.draft_server.config import DraftConfig
from specdec.draft_server.engine import DraftEngine
from specdec.errors import InvalidArgumentError
from specdec.model.runtime import ModelRuntime
from specdec.sampling.params import SamplingParams
from specdec.wire.items import Proposal, ProposeItem

K = 6
PROMPT = [504, 3575, 282, 4649, 314, 260, 1345, 28]
GREEDY = SamplingParams(temperature=0.0)
#: The penalty makes each position's q depend on the tokens before it, which a cached guess outruns.
SEEDED = SamplingParams(temperature=0.8, top_k=40, seed=11, repetition_penalty=1.3)


def engine(runtime: ModelRuntime) -> DraftEngine:
    config = DraftConfig(port=0, dtype="float32", quantization="none", measure_costs=False, kv_token_budget=512)
    return DraftEngine(runtime, config)


class Forward(NamedTuple):
    """One forward the draft ran: its widest chunk, and whether it ran as a prompt or a step."""

    width: int
    prompt: bool


def recording_forwards(draft: DraftEngine, monkeypatch: pytest.MonkeyPatch) -> list[Forward]:
    """Every forward `draft` runs from now on, one list entry per forward."""
    forwards: list[Forward] = []
    real_run = draft._run

    def spy(chunks: list[tuple[str, list[int]]], logits: str, *, prompt: bool = True) -> list[torch.Tensor]:
        forwards.append(Forward(max(len(tokens) for _, tokens in chunks), prompt))
        return real_run(chunks, logits, prompt=prompt)

    monkeypatch.setattr(draft, "_run", spy)
    return forwards


def widths(forwards: list[Forward]) -> list[int]:
    return [forward.width for forward in forwards]


def two_rounds(draft: DraftEngine, sampling: SamplingParams, guess: list[int]) -> tuple[Proposal, Proposal]:
    """A first Propose that sets up the slot, then one round with `guess` after accepting two
    of the first round's tokens (rollback and feed of the accepted prefix and a bonus token)."""
    first = draft.propose([ProposeItem("s", 0, PROMPT, K, sampling)])[0]
    accepted = first.tokens[:2] + [first.tokens[2] ^ 1]
    second = draft.propose([ProposeItem("s", len(PROMPT) + 2, accepted[2:], K, sampling, guess)])[0]
    return first, second


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_the_proposal_is_the_drafts_own_whatever_the_guess(
    fp32_runtime: ModelRuntime, sampling: SamplingParams
) -> None:
    _, plain = two_rounds(engine(fp32_runtime), sampling, [])
    own = plain.tokens
    for guess in (own, own[:3] + [own[3] ^ 1] + own[4:], [t ^ 1 for t in own], own[:2], own[:1] + [7] * (K - 1)):
        _, guessed = two_rounds(engine(fp32_runtime), sampling, guess)
        assert guessed.tokens == own
        assert guessed.cached_len == plain.cached_len
        if sampling.is_greedy:
            assert guessed.probs is None
        else:
            assert plain.probs is not None and guessed.probs is not None
            vocab = fp32_runtime.model.vocab_size
            torch.testing.assert_close(guessed.probs.distributions(vocab), plain.probs.distributions(vocab),
                                       atol=1e-5, rtol=1e-4)


def test_the_cache_after_a_parted_guess_holds_the_drafted_tokens(fp32_runtime: ModelRuntime) -> None:
    """The guessed tokens past the first wrong one leave the cache: the next round, fed the
    drafted tokens as accepted, drafts what an unguessed draft does."""
    proposals = []
    for guess in ([], [5, 6, 7, 8, 9]):
        draft = engine(fp32_runtime)
        _, second = two_rounds(draft, GREEDY, guess)
        valid = len(PROMPT) + 2 + 1
        third = draft.propose([ProposeItem("s", valid + K - 1, [second.tokens[-1], 42], K, GREEDY)])[0]
        proposals.append((second.tokens, third.tokens, list(draft.tokens["s"])))
    assert proposals[0] == proposals[1]


def test_each_kept_guessed_token_saves_a_forward(fp32_runtime: ModelRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    _, plain = two_rounds(engine(fp32_runtime), GREEDY, [])
    own = plain.tokens
    for guess, forwards in ((own, 1), (own[:3], K - 3), (own[:2] + [own[2] ^ 1], K - 2), ([own[0] ^ 1], K)):
        draft = engine(fp32_runtime)
        draft.propose([ProposeItem("s", 0, PROMPT, K, GREEDY)])
        first = draft.tokens["s"][len(PROMPT):]
        ran = recording_forwards(draft, monkeypatch)
        draft.propose([ProposeItem("s", len(PROMPT) + 2, [first[2] ^ 1], K, GREEDY, guess)])
        fed_guess = min(len(guess), K - 1)
        assert widths(ran) == [1 + fed_guess] + [1] * (forwards - 1), guess


def test_a_new_slots_prompt_feeds_no_guess(fp32_runtime: ModelRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lazy prefill scores only its last position: a guess would make it score them all."""
    plain = engine(fp32_runtime).propose([ProposeItem("s", 0, PROMPT * 3, K, GREEDY)])[0]
    draft = engine(fp32_runtime)
    ran = recording_forwards(draft, monkeypatch)
    guessed = draft.propose([ProposeItem("s", 0, PROMPT * 3, K, GREEDY, plain.tokens)])[0]
    assert guessed.tokens == plain.tokens
    assert widths(ran) == [len(PROMPT) * 3] + [1] * (K - 1)


def test_a_batch_mixes_guessed_and_unguessed_requests(fp32_runtime: ModelRuntime) -> None:
    alone = {}
    for slot, prompt in (("a", PROMPT), ("b", PROMPT[::-1])):
        alone[slot] = engine(fp32_runtime).propose([ProposeItem(slot, 0, prompt, K, SEEDED)])[0]
    draft = engine(fp32_runtime)
    draft.propose([ProposeItem("a", 0, PROMPT[:-1], 1, SEEDED), ProposeItem("b", 0, PROMPT[:0:-1], 1, SEEDED)])
    both = draft.propose([
        ProposeItem("a", len(PROMPT) - 1, PROMPT[-1:], K, SEEDED, alone["a"].tokens[:4]),
        ProposeItem("b", len(PROMPT) - 1, PROMPT[:1], K, SEEDED),
    ])
    assert [p.tokens for p in both] == [alone["a"].tokens, alone["b"].tokens]


#: A text that repeats: the draft continues it, and its own lookup finds where.
REPEATING = PROMPT * 4


def own_guess_round(draft: DraftEngine, sampling: SamplingParams, own: bool, k: int = K) -> Proposal:
    """The round after a Propose that set the slot up with all of REPEATING but its last token."""
    draft.propose([ProposeItem("s", 0, REPEATING[:-1], 1, sampling)])
    return draft.propose([ProposeItem("s", len(REPEATING) - 1, REPEATING[-1:], k, sampling, lookup_guesses=own)])[0]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_the_drafts_own_guesses_change_only_its_forwards(
    full_fp32_runtime: ModelRuntime, monkeypatch: pytest.MonkeyPatch, sampling: SamplingParams
) -> None:
    """On the whole model, whose greedy draft copies a repetition."""
    proposals, forwards, fed = [], [], []
    for own in (False, True):
        draft = engine(full_fp32_runtime)
        ran = recording_forwards(draft, monkeypatch)
        proposals.append(own_guess_round(draft, sampling, own, k=12))
        forwards.append(len(ran) - 1)  # without the set-up's prefill
        fed.append(sum(width - 1 for width in widths(ran)[1:]))  # each forward feeds one drawn token and the guess
    plain, guessed = proposals
    assert guessed.tokens == plain.tokens and guessed.cached_len == plain.cached_len
    if not sampling.is_greedy:
        assert plain.probs is not None and guessed.probs is not None
        vocab = full_fp32_runtime.model.vocab_size
        torch.testing.assert_close(guessed.probs.distributions(vocab), plain.probs.distributions(vocab),
                                   atol=1e-5, rtol=1e-4)
    # Every draw takes its row from a forward's first token or from a guessed one (saved).
    assert plain.saved_steps == plain.own_guess_tokens == 0 and forwards[0] == 12
    assert forwards[1] == 12 - guessed.saved_steps and fed[1] == guessed.own_guess_tokens
    if sampling.is_greedy:
        assert guessed.saved_steps > 0  # the greedy draft copies the repetition


def test_a_steps_guesses_share_the_budget(full_fp32_runtime: ModelRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    """A guess widens every row of the batched forward: two guessing requests get half each,
    and a budget of 0 turns the draft's own guesses off (the whole model, which copies the
    repetition)."""
    for budget, widest in ((8, 1 + 8 // 2), (0, 1)):
        config = DraftConfig(port=0, dtype="float32", quantization="none", measure_costs=False, kv_token_budget=512,
                             lookup_guess_tokens=budget)
        draft = DraftEngine(full_fp32_runtime, config)
        draft.propose([ProposeItem(slot, 0, REPEATING[:-1], 1, GREEDY) for slot in "ab"])
        ran = recording_forwards(draft, monkeypatch)
        proposals = draft.propose([ProposeItem(slot, len(REPEATING) - 1, REPEATING[-1:], 12, GREEDY,
                                               lookup_guesses=True) for slot in "ab"])
        assert max(widths(ran)) == widest and (budget == 0) == (proposals[0].saved_steps == 0)


def test_a_rollback_into_accepted_tokens_rebuilds_the_index(fp32_runtime: ModelRuntime) -> None:
    """The index covers accepted tokens only: a gateway that rolls the slot back below them
    (a truncate) leaves a fresh index, which guesses the same as a new slot's."""
    draft = engine(fp32_runtime)
    first = own_guess_round(draft, GREEDY, True)
    draft.truncate("s", 3)
    assert "s" not in draft.lookups
    again = draft.propose([ProposeItem("s", 3, REPEATING[3:], K, GREEDY, lookup_guesses=True)])[0]
    assert again.tokens == first.tokens


def test_an_invalid_guess_names_the_field(fp32_runtime: ModelRuntime) -> None:
    draft = engine(fp32_runtime)
    with pytest.raises(InvalidArgumentError, match="guess_tokens: 7 .* more than its num_speculative_tokens"):
        draft.propose([ProposeItem("s", 0, PROMPT, K, GREEDY, [1] * (K + 1))])
    with pytest.raises(InvalidArgumentError, match="guess_tokens: token id -1"):
        draft.propose([ProposeItem("s", 0, PROMPT, K, GREEDY, [-1])])
    assert "s" not in draft.tokens


@pytest.mark.parametrize("guess", [[], [5, 6, 7]], ids=["unguessed", "guessed"])
def test_after_the_prompt_every_forward_of_a_round_is_a_step(
    fp32_runtime: ModelRuntime, monkeypatch: pytest.MonkeyPatch, guess: list[int]
) -> None:
    """Steps are what a GPU replays from CUDA graphs, so feeding the accepted tokens (and a guess)
    must not take the prompt path, which runs eagerly."""
    draft = engine(fp32_runtime)
    first = draft.propose([ProposeItem("s", 0, PROMPT, K, GREEDY)])[0]
    ran = recording_forwards(draft, monkeypatch)
    accepted = first.tokens[:2] + [first.tokens[2] ^ 1]
    second = draft.propose([ProposeItem("s", len(PROMPT) + 2, accepted[2:], K, GREEDY, guess)])[0]
    assert len(second.tokens) == K
    assert ran and not any(forward.prompt for forward in ran)


def first_new_token(tokens: list[int]) -> int:
    """The position of the first token of `tokens` not seen before it, past the first."""
    return next(j for j in range(1, len(tokens)) if tokens[j] not in tokens[:j])


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("guessed", [False, True], ids=["unguessed", "guessed"])
def test_the_draft_stops_after_a_stop_token(
    fp32_runtime: ModelRuntime, sampling: SamplingParams, guessed: bool
) -> None:
    """A drawn stop token ends the item's proposal (no token after it could be kept) and is not
    cached, so the next round goes on as after any proposal of that length, guessed or not."""
    _, plain = two_rounds(engine(fp32_runtime), sampling, [])
    j = first_new_token(plain.tokens)
    draft = engine(fp32_runtime)
    first = draft.propose([ProposeItem("s", 0, PROMPT, K, sampling)])[0]
    accepted = first.tokens[:2] + [first.tokens[2] ^ 1]
    guess = plain.tokens[: K - 1] if guessed else []
    stops = (plain.tokens[j], 0)
    item = ProposeItem("s", len(PROMPT) + 2, accepted[2:], K, sampling, guess, stop_token_ids=stops)
    stopped = draft.propose([item])[0]
    assert stopped.tokens == plain.tokens[: j + 1]
    valid = len(PROMPT) + 3
    assert stopped.cached_len == len(draft.tokens["s"]) == valid + j
    if not sampling.is_greedy:
        assert stopped.probs is not None and len(stopped.probs.distributions(fp32_runtime.model.vocab_size)) == j + 1
    # Accept all but the stop token and go on: the same as a draft that never stopped.
    after = draft.propose([ProposeItem("s", valid + j, [42], K, sampling)])[0]
    reference = engine(fp32_runtime)
    two_rounds(reference, sampling, [])
    assert after.tokens == reference.propose([ProposeItem("s", valid + j, [42], K, sampling)])[0].tokens


def test_a_stopped_item_leaves_the_batch_drafting(fp32_runtime: ModelRuntime) -> None:
    alone = {slot: engine(fp32_runtime).propose([ProposeItem(slot, 0, prompt, K, GREEDY)])[0]
             for slot, prompt in (("a", PROMPT), ("b", PROMPT[::-1]))}
    j = first_new_token(alone["a"].tokens)
    both = engine(fp32_runtime).propose([
        ProposeItem("a", 0, PROMPT, K, GREEDY, stop_token_ids=(alone["a"].tokens[j],)),
        ProposeItem("b", 0, PROMPT[::-1], K, GREEDY),
    ])
    assert [p.tokens for p in both] == [alone["a"].tokens[: j + 1], alone["b"].tokens]


def test_an_invalid_stop_token_names_the_field(fp32_runtime: ModelRuntime) -> None:
    draft = engine(fp32_runtime)
    with pytest.raises(InvalidArgumentError, match="stop_token_ids: token id -1"):
        draft.propose([ProposeItem("s", 0, PROMPT, K, GREEDY, stop_token_ids=(-1,))])
    assert "s" not in draft.tokens
