"""Structured output without a model: masks along a draft, the cut a round makes, bad specs."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from specdec.errors import InvalidArgumentError
from specdec.gateway.detokenizer import StopStringDetokenizer
from specdec.gateway.draft_sources import DraftSource
from specdec.gateway.grammar import Choice, JsonSchema, Regex, structured_output_from_pb
from specdec.gateway.grammar.rounds import PrefixPays, constrain, with_forced_tokens
from specdec.gateway.planner.costs import CostEstimates
from specdec.gateway.proposers import LookupDraft
from specdec.gateway.request import Request, Verification
from specdec.gateway.rounds import RoundPlan
from specdec.grammar import GrammarCompiler
from specdec.model.choices import DEFAULT_MODEL
from specdec.model.loader import load_tokenizer
from specdec.sampling.params import SamplingParams
from specdec.sampling.sparse_probs import SparseRows
from specdec.sampling.token_masks import TokenMasks
from specdec.v1 import gateway_pb2
from specdec.wire.items import Proposal
from tests.unit.gateway.test_k_planner import TARGET
from tests.unit.gateway.test_source_choice import wide_draft_costs

EOS = 2
VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def compiler(tokenizer: PreTrainedTokenizerBase) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, [EOS])


def always_pays(batch: int, forced: int, k: int) -> bool:
    """Every forced prefix pays (`CostEstimates.forced_prefix_pays` is tested on its own)."""
    return True


def sequence(temperature: float = 0.0, verification: Verification = Verification.REJECTION) -> Request:
    sampling = SamplingParams(temperature=temperature)
    return Request(
        slot_id="s", prompt=[1, 2, 3], sampling=sampling, max_new_tokens=100, num_speculative_tokens=3,
        detokenizer=StopStringDetokenizer.__new__(StopStringDetokenizer), generator=torch.Generator(),
        draft_sampling=sampling, target_sampling=sampling, verification=verification,
    )


def _ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_masks_along_a_draft_stop_at_the_first_refused_token(compiler: GrammarCompiler,
                                                               tokenizer: PreTrainedTokenizerBase) -> None:
    grammar = compiler.compile(Regex(r"[0-9]{4}").grammar(), "regex")
    digits = _ids(tokenizer, "2")
    letter = _ids(tokenizer, "x")
    masks, legal = grammar.masks_along(digits * 2 + letter + digits)
    assert legal == 2 and masks.rows == 3
    assert masks.allows(0, digits[0]) and not masks.allows(2, letter[0])
    # The walk left the state where it was: the same first row again.
    assert torch.equal(grammar.masks_along([])[0].words[0], masks.words[0])


def test_a_stop_token_ends_the_walk_and_completes_the_grammar(compiler: GrammarCompiler,
                                                              tokenizer: PreTrainedTokenizerBase) -> None:
    grammar = compiler.compile(Choice(("yes", "no")).grammar(), "choice")
    yes = _ids(tokenizer, "yes")
    masks, legal = grammar.masks_along(yes + [EOS, EOS])
    assert legal == len(yes) + 1 and masks.rows == legal + 1
    grammar.advance(yes, {EOS})
    assert grammar.complete
    only = grammar.masks_along([])[0].allowed(VOCAB)[0]
    assert only.nonzero().flatten().tolist() == [EOS]


@pytest.mark.parametrize(("temperature", "verification", "lookup", "kept"), [
    (0.0, Verification.REJECTION, False, 1),   # greedy: the refused token goes
    (1.0, Verification.DRAWN, False, 1),       # seeded draws: likewise
    (1.0, Verification.REJECTION, True, 1),    # a lookup's one-hot q: likewise
    (1.0, Verification.REJECTION, False, 2),   # a model draft judged by rejection keeps it, to be rejected
])
def test_a_round_cuts_a_draft_where_its_grammar_refuses_a_token(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase, temperature: float,
    verification: Verification, lookup: bool, kept: int,
) -> None:
    seq = sequence(temperature=temperature, verification=verification)
    seq.grammar = compiler.compile(Regex(r"[0-9]+").grammar(), "regex")
    drafted = _ids(tokenizer, "7") + _ids(tokenizer, "x") + _ids(tokenizer, "8")
    probs = SparseRows.one_hot(drafted) if temperature else None
    proposals, masks = constrain([seq], {seq.slot_id: Proposal(seq.slot_id, drafted, probs, 0)},
                                 [seq.slot_id] if lookup else [])
    assert proposals[seq.slot_id].tokens == drafted[:kept]
    assert masks[seq.slot_id].rows == kept + 1
    if probs is not None:
        assert proposals[seq.slot_id].probs.num_rows == kept  # type: ignore[union-attr]


def test_a_draft_refused_at_its_first_token_leaves_a_plain_round(compiler: GrammarCompiler,
                                                                 tokenizer: PreTrainedTokenizerBase) -> None:
    seq = sequence()
    seq.grammar = compiler.compile(Regex(r"[0-9]+").grammar(), "regex")
    proposals, masks = constrain([seq], {seq.slot_id: Proposal(seq.slot_id, _ids(tokenizer, "x"), None, 0)}, [])
    assert proposals == {} and masks[seq.slot_id].rows == 1


def test_packed_masks_round_trip_and_apply() -> None:
    words = torch.zeros(2, 2, dtype=torch.int32)
    words[0, 0], words[1, 1] = 0b101, 1 << 3  # row 0: tokens 0, 2; row 1: token 35
    masks = TokenMasks(words)
    again = TokenMasks.from_bytes(masks.to_bytes(), 2, 2)
    assert torch.equal(again.words, words)
    assert torch.equal(TokenMasks.from_allowed(masks.allowed(64)).words, words)
    high = torch.zeros(1, 32, dtype=torch.bool)
    high[0, 31] = True  # the sign bit of an int32 word
    assert TokenMasks.from_allowed(high).allows(0, 31)
    out = masks.apply(torch.zeros(2, 40))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [35]
    assert masks.apply(torch.zeros(2, 40, dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(InvalidArgumentError, match="allows no token"):
        TokenMasks(torch.zeros(1, 2, dtype=torch.int32)).check(1, 40, "allowed")
    with pytest.raises(InvalidArgumentError, match="allows no token"):  # token 45 lies past a vocabulary of 40
        TokenMasks(torch.tensor([[0, 1 << 13]], dtype=torch.int32)).check(1, 40, "allowed")
    with pytest.raises(InvalidArgumentError, match="rows"):
        masks.check(3, 40, "allowed")
    with pytest.raises(InvalidArgumentError):
        TokenMasks.from_bytes(b"\0" * 7, 1, 2)


@pytest.mark.parametrize(("message", "field"), [
    (gateway_pb2.StructuredOutput(), "structured_output: set one of"),
    (gateway_pb2.StructuredOutput(json_schema="[1]"), "structured_output.json_schema: a schema is a JSON object"),
    (gateway_pb2.StructuredOutput(json_schema='{"a": ' * 100 + "1" + "}" * 100),
     "structured_output.json_schema: nested deeper"),
    (gateway_pb2.StructuredOutput(regex=""), "structured_output.regex: empty"),
    (gateway_pb2.StructuredOutput(choice=gateway_pb2.StructuredOutput.Choice(options=["a", ""])),
     "structured_output.choice: give 1 to"),
])
def test_a_bad_spec_names_its_field(message: gateway_pb2.StructuredOutput, field: str) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        structured_output_from_pb(message, "structured_output")
    assert str(raised.value).startswith(field)


def test_schemas_that_differ_in_blanks_share_one_compiled_grammar(compiler: GrammarCompiler) -> None:
    spaced = gateway_pb2.StructuredOutput(json_schema='{"type": "object",  "required": []}')
    tight = gateway_pb2.StructuredOutput(json_schema=json.dumps({"type": "object", "required": []},
                                                                separators=(",", ":")))
    before, _ = compiler.cached()
    for message in (spaced, tight):
        output = structured_output_from_pb(message, "structured_output")
        assert isinstance(output, JsonSchema)
        compiler.compile(output.grammar(), "structured_output.json_schema")
    assert compiler.cached()[0] == before + 1


def test_the_cache_keeps_to_its_bytes_of_grammar_text(tokenizer: PreTrainedTokenizerBase) -> None:
    texts = [Regex(f"[0-9]{{{n}}}").grammar() for n in range(1, 6)]
    small = GrammarCompiler(tokenizer, 49152, [tokenizer.eos_token_id], max_bytes=2 * max(map(len, texts)))
    for text in texts:
        small.compile(text, "regex")
    entries, size = small.cached()
    assert entries == 2 and size == sum(map(len, texts[-2:]))  # the least recently used went first
    small.compile(texts[-1], "regex")  # a hit compiles nothing and keeps the count
    assert small.cached() == (entries, size)


def test_the_answer_keeps_the_schemas_property_order(compiler: GrammarCompiler,
                                                     tokenizer: PreTrainedTokenizerBase) -> None:
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    message = gateway_pb2.StructuredOutput(json_schema=json.dumps(schema))
    grammar = compiler.compile(structured_output_from_pb(message, "structured_output").grammar(), "structured_output")
    answer = _ids(tokenizer, '{"zeta":1,"alpha":2}')
    assert grammar.masks_along(answer)[1] == len(answer)


def test_forced_tokens_replace_a_plain_or_lookup_round_up_to_the_cap(compiler: GrammarCompiler,
                                                                    tokenizer: PreTrainedTokenizerBase) -> None:
    seq, free = sequence(), sequence()
    free.slot_id = "free"
    seq.grammar = compiler.compile(Regex(r"hello world [0-9]").grammar(), "regex")
    lookup = LookupDraft((1, 2), DraftSource.SUFFIX, 2)
    for plan in (RoundPlan(ks={"s": 0, "free": 4}, steps={"s": 3}),
                 RoundPlan(ks={"s": 2, "free": 4}, lookups={"s": lookup})):
        forced = with_forced_tokens(plan, [seq, free], {"s": 2, "free": 4}, always_pays)
        draft = forced.lookups["s"]
        assert draft.source is DraftSource.GRAMMAR and len(draft.tokens) == forced.ks["s"] == 2
        assert tokenizer.decode(list(draft.tokens)) == "hello world"[: len(tokenizer.decode(list(draft.tokens)))]
        assert forced.ks["free"] == 4 and "free" not in forced.lookups and forced.steps == {}
        assert forced.model_ks == {"s": 0, "free": 4}
    seq.grammar.advance(list(tokenizer("hello world ", add_special_tokens=False)["input_ids"]), {EOS})
    assert with_forced_tokens(plan, [seq, free], {"s": 2, "free": 4}, always_pays) is plan  # a digit: nothing forced


def test_forced_tokens_lengthen_a_model_draft_which_guesses_them(compiler: GrammarCompiler) -> None:
    seq = sequence()
    seq.grammar = compiler.compile(Regex(r"hello world [0-9]").grammar(), "regex")
    forced_count = len(seq.grammar.forced_tokens())
    plan = RoundPlan(ks={"s": 3}, guesses={"s": LookupDraft((1, 2), DraftSource.SUFFIX, 2)})
    longer = with_forced_tokens(plan, [seq], {"s": 16}, always_pays)
    assert longer.ks == longer.model_ks == {"s": 3 + forced_count} and not longer.lookups
    assert not longer.guesses  # the draft feeds the forced tokens in its place
    assert with_forced_tokens(plan, [seq], {"s": 4}, always_pays).ks == {"s": 4}  # the cap holds
    never: PrefixPays = lambda batch, forced, k: False  # noqa: E731
    alone = with_forced_tokens(plan, [seq], {"s": 16}, never)
    assert alone.lookups["s"].source is DraftSource.GRAMMAR and alone.model_ks == {"s": 0}


def test_a_forced_prefix_widens_the_draft_where_its_table_says_the_width_is_cheap() -> None:
    # A CPU-like draft: each token of width adds 15 % of a step, padded over the whole batch.
    costs = CostEstimates(TARGET, wide_draft_costs(0.25))
    assert costs.forced_prefix_pays(1, 6, 4)
    assert not costs.forced_prefix_pays(16, 6, 4)  # 16 rows padded to 8 tokens for one request's 6
    assert CostEstimates(TARGET, []).forced_prefix_pays(1, 6, 4)  # unpriced: alone only
    assert not CostEstimates(TARGET, []).forced_prefix_pays(2, 6, 4)
