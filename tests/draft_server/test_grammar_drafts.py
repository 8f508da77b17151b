"""A structured-output request's grammar in the draft: every drafted token is one the grammar
allows (q masked by it), the tokens it forces are drafted without a step each, and the walk
follows the slot's rollbacks from round to round. In process on the fp32 model."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.draft_server.config import DraftConfig
from specdec.draft_server.engine import DraftEngine
from specdec.errors import InvalidArgumentError
from specdec.gateway.grammar import Choice, JsonSchema
from specdec.grammar import GrammarCompiler, RequestGrammar
from specdec.model.runtime import ModelRuntime
from specdec.sampling.params import SamplingParams
from specdec.wire.items import DraftGrammar, Proposal, ProposeItem
from tests.draft_server.test_guesses import recording_forwards

PROMPT = [504, 3575, 282, 4649, 314, 260, 1345, 28]
K = 8
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0, seed=5)
PERSON = JsonSchema(json.dumps({
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False,
})).grammar()
#: Options the model would not pick unasked: an unmasked draft proposes other tokens.
WORDS = Choice(("zebra crossing", "quantum yodel", "marmalade sky")).grammar()


def draft_engine(runtime: ModelRuntime) -> DraftEngine:
    config = DraftConfig(port=0, dtype="float32", quantization="none", measure_costs=False, kv_token_budget=512)
    return DraftEngine(runtime, config)


def gateway_walk(runtime: ModelRuntime, text: str) -> RequestGrammar:
    tokenizer = runtime.loaded.tokenizer
    return GrammarCompiler(tokenizer, runtime.model.vocab_size, [tokenizer.eos_token_id]).compile(text, "t")


def legal(walk: RequestGrammar, tokens: list[int]) -> int:
    """Draft tokens the gateway's own walk allows before its first refusal."""
    return walk.masks_along(tokens)[1]


def propose(engine: DraftEngine, text: str, sampling: SamplingParams, valid_len: int = 0,
            new: list[int] = PROMPT, forced: bool = True, k: int = K) -> Proposal:
    grammar = DraftGrammar(text, len(PROMPT), forced)
    stops = (engine.runtime.loaded.tokenizer.eos_token_id,)
    return engine.propose([ProposeItem("s", valid_len, new, k, sampling, stop_token_ids=stops, grammar=grammar)])[0]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_every_drafted_token_is_one_the_grammar_allows(fp32_runtime: ModelRuntime, sampling: SamplingParams) -> None:
    unmasked = draft_engine(fp32_runtime).propose([ProposeItem("s", 0, PROMPT, K, sampling)])[0]
    assert legal(gateway_walk(fp32_runtime, WORDS), unmasked.tokens) < K  # the grammar has work to do
    for text in (WORDS, PERSON):
        proposal = propose(draft_engine(fp32_runtime), text, sampling)
        walk = gateway_walk(fp32_runtime, text)
        assert legal(walk, proposal.tokens) == len(proposal.tokens) > 0
        if not sampling.is_greedy:  # q is the masked distribution: all its mass on allowed tokens
            assert proposal.probs is not None
            rows, _ = walk.masks_along(proposal.tokens)
            q = proposal.probs.distributions(fp32_runtime.model.vocab_size)  # [k, vocab]
            allowed = rows.allowed(q.shape[-1])[: len(proposal.tokens)]
            assert torch.all(q[~allowed] == 0)


def test_forced_tokens_are_drafted_without_a_step_each(full_fp32_runtime: ModelRuntime,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """On the whole model, which writes a name and an age the grammar then closes."""
    stepwise = draft_engine(full_fp32_runtime)
    plain = propose(stepwise, PERSON, GREEDY, forced=False)
    guessing = draft_engine(full_fp32_runtime)
    forwards = recording_forwards(guessing, monkeypatch)
    guessed = propose(guessing, PERSON, GREEDY)
    assert guessed.tokens == plain.tokens  # the same draws: each forced token is the only one allowed
    assert plain.forced_steps == plain.forced_tokens == 0
    # '{"name":"' is forced from the start, '","age":' after the name: each forced token saves a forward.
    assert guessed.forced_steps >= 3 and guessed.forced_tokens >= guessed.forced_steps
    assert len(forwards) == 1 + (K - 1) - guessed.forced_steps  # the feed, then one per draw not forced


def test_the_walk_follows_the_slots_rollbacks(fp32_runtime: ModelRuntime) -> None:
    engine = draft_engine(fp32_runtime)
    walk = gateway_walk(fp32_runtime, PERSON)
    first = propose(engine, PERSON, GREEDY)
    kept = first.tokens[:4]  # the gateway accepted 4 and its target chose the 5th: the draft's own
    walk.advance(kept, {fp32_runtime.loaded.tokenizer.eos_token_id})
    choice = walk.masks_along([])[0].allowed(fp32_runtime.model.vocab_size)[0].nonzero().flatten().tolist()
    bonus = next(t for t in choice if t != first.tokens[4]) if len(choice) > 1 else choice[0]
    second = propose(engine, PERSON, GREEDY, valid_len=len(PROMPT) + 3, new=[kept[3], bonus])
    walk.advance([bonus], set())
    assert legal(walk, second.tokens) == len(second.tokens)
    engine.release("s")
    assert "s" not in engine.grammars.slots


def test_a_grammar_must_start_within_the_slots_tokens(fp32_runtime: ModelRuntime) -> None:
    engine = draft_engine(fp32_runtime)
    bad = ProposeItem("s", 0, PROMPT, K, GREEDY, grammar=DraftGrammar(WORDS, len(PROMPT) + 1))
    with pytest.raises(InvalidArgumentError, match="grammar.start"):
        engine.propose([bad])
    assert "s" not in engine.tokens


def test_a_grammar_the_draft_cannot_compile_leaves_the_slot_unmasked(fp32_runtime: ModelRuntime) -> None:
    engine = draft_engine(fp32_runtime)
    broken = engine.propose([ProposeItem("s", 0, PROMPT, K, GREEDY, grammar=DraftGrammar("%%% not a grammar", 8))])[0]
    plain = draft_engine(fp32_runtime).propose([ProposeItem("s", 0, PROMPT, K, GREEDY)])[0]
    assert broken.tokens == plain.tokens and "s" not in engine.grammars.slots
