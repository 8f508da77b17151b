"""Logprobs through a real loopback stack equal plain decoding's, speculation on or off.

Each request runs with speculation (Argmax, Logits, Drawn or Sampled rounds) and without it
(the target's multi-step Decode rounds), and every returned logprob and top list is checked
against a direct forward of the model (`transformers`) over the prompt and the tokens the
request emitted. Greedy and seeded requests emit the same tokens either way (a seeded one is
judged against the target's own draws), so their logprobs are also compared with each other;
a seeded request under rejection sampling parts from plain decoding after a few tokens (its
acceptance draws are not plain decoding's), so each of its runs is checked on its own tokens.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
import torch

from specdec.client import GenerationResult, TokenLogprob
from specdec.model.chat import encode_chat
from specdec.model.loader import LoadedModel
from specdec.sampling.logprobs import LogprobsOptions
from specdec.sampling.params import SamplingParams
from specdec.sampling.transforms import logits_to_probs
from tests.support.stacks import Stack, chat, generate_all

PROMPTS = ["What is the capital of France?", "Name three kinds of tree."]
MAX_NEW_TOKENS = 12
TOP = 5
#: Between two runs of the same forward (speculative and plain): fp32 rounding alone.
SAME_MODEL_ABS = 1e-4
#: Against `transformers`' own forward of the same weights (other kernels).
REFERENCE_ABS = 1e-4

CASES = {
    "greedy-raw": dict(temperature=0.0),
    "greedy-processed": dict(temperature=0.0, top_k=8, repetition_penalty=1.3, processed_logprobs=True),
    "sampled-raw": dict(temperature=0.8, top_p=0.9, seed=11),
    "sampled-processed": dict(temperature=0.8, top_k=20, repetition_penalty=1.1, seed=12, processed_logprobs=True),
    "sampled-rejection": dict(temperature=0.8, top_p=0.9, seed=13, verification="rejection"),
}


def _params(options: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**{k: v for k, v in options.items() if k in ("temperature", "top_k", "top_p",
                                                                         "repetition_penalty")})


def _reference(model: LoadedModel, prompt: list[int], result: GenerationResult,
               options: dict[str, Any]) -> torch.Tensor:
    """Plain decoding's logprobs [n, vocab] at each emitted token's position, from one forward."""
    tokens = result.token_ids
    with torch.inference_mode():
        logits = model.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()  # [n, vocab]
    request = LogprobsOptions(TOP, options.get("processed_logprobs", False)).request_for(_params(options))
    if request.transforms is None:
        return torch.log_softmax(logits, dim=-1)
    return torch.stack([logits_to_probs(logits[i : i + 1], [request.transforms], [prompt + tokens[:i]])[0].log()
                        for i in range(len(tokens))])  # [n, vocab]


def _check_against(reference: torch.Tensor, result: GenerationResult) -> None:
    assert [t.token_id for t in result.logprobs] == result.token_ids
    for i, token in enumerate(result.logprobs):
        row = reference[i]  # [vocab]
        assert token.logprob == pytest.approx(row[token.token_id].item(), abs=REFERENCE_ABS), i
        assert token.logprob > float("-inf")  # a chosen token had a chance
        ids, values = [t for t, _ in token.top], [v for _, v in token.top]
        assert len(ids) == TOP and values == sorted(values, reverse=True), token
        assert values == pytest.approx(row.topk(TOP).values.tolist(), abs=REFERENCE_ABS)
        if token.logprob > values[-1] + REFERENCE_ABS:
            assert token.token_id in ids, token


def _same(a: list[TokenLogprob], b: list[TokenLogprob]) -> None:
    """Equal logprobs and alternatives, up to fp32 rounding (alternatives closer than that may swap)."""
    for x, y in zip(a, b, strict=True):
        assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=SAME_MODEL_ABS)
        assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=SAME_MODEL_ABS)
        distinct = [i for i, (v, w) in enumerate(zip(x.top, x.top[1:])) if v[1] - w[1] > SAME_MODEL_ABS]
        assert [x.top[i][0] for i in distinct] == [y.top[i][0] for i in distinct]


@pytest.mark.parametrize("case", list(CASES))
def test_logprobs_equal_plain_decoding_with_and_without_speculation(
    case: str, int8_stack: Stack, target_model: LoadedModel
) -> None:
    options = dict(CASES[case], logprobs=TOP)
    speculative = generate_all(int8_stack, PROMPTS, MAX_NEW_TOKENS, num_speculative_tokens=4, **options)
    plain = generate_all(int8_stack, PROMPTS, MAX_NEW_TOKENS, speculative=False, **options)
    assert sum(r.num_draft_tokens for r in speculative) > 0 and sum(r.num_draft_tokens for r in plain) == 0
    assert any(len(chunk) > 1 for r in plain for chunk in r.chunks)  # multi-step Decode rounds
    for text, spec, base in zip(PROMPTS, speculative, plain):
        prompt = encode_chat(target_model.tokenizer, chat(text))
        for result in (spec, base):
            _check_against(_reference(target_model, prompt, result, options), result)
        if options.get("verification") != "rejection":
            assert spec.token_ids == base.token_ids
            _same(spec.logprobs, base.logprobs)
    int8_stack.wait_until_idle()


def test_requests_without_logprobs_get_none(int8_stack: Stack) -> None:
    with int8_stack.client() as client:
        result = client.generate(chat(PROMPTS[0]), max_new_tokens=4)
        zero = client.generate(chat(PROMPTS[0]), max_new_tokens=4, logprobs=0)
    assert result.logprobs == [] and len(result.token_ids) == 4
    assert len(zero.logprobs) == 4 and all(t.top == [] for t in zero.logprobs)


def test_top_logprobs_outside_zero_to_twenty_is_invalid(int8_stack: Stack) -> None:
    with int8_stack.client() as client, pytest.raises(grpc.RpcError) as caught:
        client.generate(chat(PROMPTS[0]), max_new_tokens=4, logprobs=21)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "logprobs.top_logprobs" in caught.value.details()
