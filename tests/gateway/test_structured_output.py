"""Structured output on the real stack: every token is one the grammar allows, and speculation
changes nothing about which.

Greedy: speculative (model draft, mostly accepted or mostly rejected; lookups) == plain decoding
on the stack == transformers' greedy generate with the grammar's mask applied by a logits
processor of its own, token for token. Sampled: the second token of a constrained answer follows
the grammar-masked distribution under rejection sampling with the weak draft (whose tokens the
grammar often refuses, the path that keeps a refused token to be rejected).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import torch
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList

from specdec.gateway.grammar import Choice, JsonObject, JsonSchema, Regex, StructuredOutput
from specdec.grammar import GrammarCompiler
from specdec.model.chat import encode_chat
from specdec.model.loader import LoadedModel
from tests.support.marginals import marginal_p_value
from tests.support.stacks import Stack, chat, generate_all

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
COLOURS = ["red", "green", "blue", "yellow"]
DATE = r"\d{4}-\d{2}-\d{2}"
#: (prompt, client option, the kind as the gateway reads it, a check of the finished text)
CASES: list[tuple[str, dict[str, Any], StructuredOutput, Callable[[str], bool]]] = [
    ("Describe a user of a web app as JSON.", {"json_schema": PERSON},
     JsonSchema(json.dumps(PERSON, separators=(",", ":"))),
     lambda text: list(json.loads(text)) == ["name", "age", "role"] and json.loads(text)["role"] in
     ("admin", "user", "guest") and isinstance(json.loads(text)["age"], int)),
    ("Give me a JSON object describing a cat.", {"json_object": True}, JsonObject(),
     lambda text: isinstance(json.loads(text), dict)),
    ("What colour is the sky?", {"choice": COLOURS}, Choice(tuple(COLOURS)), lambda text: text in COLOURS),
    ("When did the first person walk on the moon?", {"regex": DATE}, Regex(DATE),
     lambda text: re.fullmatch(DATE, text) is not None),
]
MAX_NEW_TOKENS = 48


class GrammarMask(LogitsProcessor):
    """transformers' side of the comparison: a fresh walk through the grammar, each generated
    token consumed before the next row is masked."""

    def __init__(self, compiler: GrammarCompiler, output: StructuredOutput, prompt_len: int) -> None:
        self.grammar, self.prompt_len = compiler.compile(output.grammar(), "test"), prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[0, self.prompt_len:].tolist()
        if generated:
            assert self.grammar.matcher.consume_token(generated[-1])
        masks, _ = self.grammar.masks_along([])
        return masks.apply(scores)


@pytest.fixture(scope="module")
def compiler(target_model: LoadedModel) -> GrammarCompiler:
    tokenizer = target_model.tokenizer
    return GrammarCompiler(tokenizer, target_model.model.config.vocab_size, [tokenizer.eos_token_id])


@pytest.fixture(scope="module")
def expected(target_model: LoadedModel, compiler: GrammarCompiler) -> list[list[int]]:
    """transformers' greedy answer to each case under its grammar, EOS stripped."""
    answers = []
    for prompt, _, output, _ in CASES:
        ids = encode_chat(target_model.tokenizer, chat(prompt))
        with torch.inference_mode():
            out = target_model.model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                pad_token_id=target_model.tokenizer.eos_token_id,
                logits_processor=LogitsProcessorList([GrammarMask(compiler, output, len(ids))]),
            )
        generated = out[0, len(ids):].tolist()
        eos = target_model.tokenizer.eos_token_id
        answers.append(generated[: generated.index(eos)] if eos in generated else generated)
    return answers


def _run_case(stack: Stack, case: int, **options: Any) -> Any:
    prompt, constraint, *_ = CASES[case]
    return generate_all(stack, [prompt], MAX_NEW_TOKENS, **constraint, **options)[0]


def _run_cases(stack: Stack, **options: Any) -> list[Any]:
    """Every case at once, so that batched rounds mix the grammars (and items their grammar cuts)."""
    with ThreadPoolExecutor(len(CASES)) as pool:
        return list(pool.map(lambda case: _run_case(stack, case, **options), range(len(CASES))))


@pytest.mark.parametrize("stack_name", ["int8_stack", "weak_stack"])
def test_greedy_structured_output_is_plain_decoding_under_the_grammar(
    stack_name: str, expected: list[list[int]], request: pytest.FixtureRequest
) -> None:
    stack: Stack = request.getfixturevalue(stack_name)
    plains, speculatives = _run_cases(stack, speculative=False), _run_cases(stack, num_speculative_tokens=4)
    for case, (prompt, _, _, valid) in enumerate(CASES):
        plain, speculative = plains[case], speculatives[case]
        assert plain.token_ids == expected[case], f"plain decoding left transformers' answer on {prompt!r}"
        assert speculative.token_ids == expected[case], f"speculation changed the answer on {prompt!r}"
        if isinstance(CASES[case][2], JsonSchema):  # punctuation and enum values are forced: free drafts, all kept
            assert speculative.num_forced_tokens > 0
            assert speculative.num_lookup_accepted_tokens == speculative.num_lookup_draft_tokens
            assert plain.num_draft_tokens == plain.num_forced_tokens == 0  # no speculation asked, none given
        # Free JSON leaves the 135M model room to ramble past the token budget; the others end.
        if not isinstance(CASES[case][2], JsonObject) or speculative.finish_reason == "stop":
            assert speculative.finish_reason == "stop" and valid(speculative.text), speculative.text
    stack.wait_until_idle()


def test_lookup_drafts_are_cut_at_the_first_refused_token(int8_stack: Stack, expected: list[list[int]]) -> None:
    looked_up = _run_cases(int8_stack, method="ngram", num_speculative_tokens=4)
    assert [result.token_ids for result in looked_up] == expected


def test_a_free_request_among_structured_ones_keeps_its_own_answer(int8_stack: Stack) -> None:
    """Batched rounds mix masked and unmasked items: the unmasked one is not masked."""
    free_prompt = CASES[0][0]
    alone = generate_all(int8_stack, [free_prompt], MAX_NEW_TOKENS, num_speculative_tokens=4)[0]
    with ThreadPoolExecutor(2) as pool:
        constrained = pool.submit(_run_cases, int8_stack, num_speculative_tokens=4)
        free = pool.submit(generate_all, int8_stack, [free_prompt], MAX_NEW_TOKENS, num_speculative_tokens=4)
        assert free.result()[0].token_ids == alone.token_ids
        constrained.result()


SAMPLED_PROMPT = "My favourite colour is"
SAMPLES = 320


def test_sampled_structured_output_follows_the_masked_distribution(
    weak_stack: Stack, target_model: LoadedModel, compiler: GrammarCompiler
) -> None:
    """The second token of a choice among phrases that share no first token. Three new tokens:
    the round after the first token then drafts one, so the second token is decided by a
    speculation round, the weak draft's token judged by rejection sampling against p under the
    grammar (the draft knows no grammar: its token is often refused, the path that keeps it to be
    rejected)."""
    options = ["light blue", "dark green", "bright red", "pale yellow"]
    exact = _masked_second_token(target_model, compiler, Choice(tuple(options)),
                                 list(target_model.tokenizer(SAMPLED_PROMPT)["input_ids"]))
    with weak_stack.client() as client, ThreadPoolExecutor(16) as pool:
        results = list(pool.map(
            lambda seed: client.generate(SAMPLED_PROMPT, max_new_tokens=3, temperature=1.0, choice=options, seed=seed,
                                         num_speculative_tokens=3, verification="rejection"),
            range(SAMPLES),
        ))
    assert sum(r.num_draft_tokens for r in results) >= SAMPLES // 2
    assert all(any(option.startswith(r.text) for option in options) for r in results)  # 3 tokens may not finish
    assert marginal_p_value([r.token_ids[1] for r in results], exact) > 1e-3


def _masked_second_token(loaded: LoadedModel, compiler: GrammarCompiler, output: StructuredOutput,
                         prompt: list[int]) -> dict[int, float]:
    """P(t2) = Σ_t1 p(t1) p(t2 | t1), each p the model's softmax under the grammar's mask."""
    grammar = compiler.compile(output.grammar(), "test")

    def probs(ids: list[int]) -> torch.Tensor:  # [vocab]
        with torch.inference_mode():
            logits = loaded.model(torch.tensor([ids])).logits[0, -1:].float()
        return torch.softmax(grammar.masks_along([])[0].apply(logits)[0], dim=-1)

    first = probs(prompt)
    marginal: dict[int, float] = {}
    for t1 in torch.nonzero(first).flatten().tolist():
        assert grammar.matcher.consume_token(t1)
        second = probs(prompt + [t1])
        grammar.matcher.rollback(1)
        for t2 in torch.nonzero(second).flatten().tolist():
            marginal[t2] = marginal.get(t2, 0.0) + float(first[t1] * second[t2])
    return marginal


@pytest.mark.parametrize(("option", "field"), [
    ({"json_schema": '{"type": "object", "properties": {"a": {"type": "strng"}}}'}, "structured_output.json_schema"),
    ({"json_schema": "{not json"}, "structured_output.json_schema"),
    ({"json_schema": "[" * 5000 + "]" * 5000}, "structured_output.json_schema"),
    ({"regex": "("}, "structured_output.regex"),
    ({"choice": []}, "structured_output"),
    ({"choice": ["a", ""]}, "structured_output.choice"),
    ({"grammar": "start: undefined_rule"}, "structured_output.grammar"),
])
def test_a_bad_grammar_is_invalid_argument_naming_the_field(int8_stack: Stack, option: dict[str, Any],
                                                            field: str) -> None:
    with int8_stack.client() as client, pytest.raises(grpc.RpcError) as raised:
        client.generate("Hi", max_new_tokens=2, **option)
    error = raised.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert (error.details() or "").startswith(field), error.details()
    int8_stack.wait_until_idle()
