"""q on the wire in bf16: the draft samples from the rounded q, and the gateway judges its
tokens against exactly that distribution. Deterministic: the tensors are compared bit for
bit, no statistics."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from specdec.draft_server import engine as draft_engine_module
from specdec.draft_server.config import DraftConfig
from specdec.draft_server.engine import DraftEngine
from specdec.gateway import speculative_step
from specdec.gateway.detokenizer import StopStringDetokenizer
from specdec.gateway.sequence import Sequence
from specdec.model.runtime import ModelRuntime
from specdec.sampling.params import SamplingParams
from specdec.sampling.rejection_sampler import sampled_distribution
from specdec.sampling.transforms import make_generator
from specdec.wire.items import Proposal, ProposeItem, VerifiedChunk

K = 3
PROMPT = [504, 3575, 282, 4649, 314]


def test_bf16_q_is_the_distribution_sampled_from_and_judged_against(
    fp32_runtime: ModelRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    sampled_from: list[torch.Tensor] = []
    real_pick_tokens = draft_engine_module.pick_tokens

    def spy_pick_tokens(probs: torch.Tensor, *args: Any) -> torch.Tensor:
        sampled_from.append(probs.clone())  # [n, vocab]: what the tokens were drawn from
        return real_pick_tokens(probs, *args)

    monkeypatch.setattr(draft_engine_module, "pick_tokens", spy_pick_tokens)
    config = DraftConfig(port=0, dtype="float32", quantization="none", measure_costs=False, kv_token_budget=256)
    sampling = SamplingParams(temperature=0.9, top_k=50, seed=7)
    proposal = DraftEngine(fp32_runtime, config).propose(
        [ProposeItem("s", 0, PROMPT, K, sampling)], probs_dtype=torch.bfloat16
    )[0]
    wire = Proposal.from_pb(proposal.to_pb())  # what the gateway receives
    assert wire.probs is not None and wire.probs.dtype == torch.bfloat16 and wire.probs.shape[0] == K

    # 1. The draft drew each token from the rounded q itself, not from the fp32 q before rounding.
    drawn = torch.cat(sampled_from)  # [K, vocab], one row per drafting step
    assert torch.equal(drawn, wire.probs.float())
    rows_sum = drawn.sum(-1)
    assert not torch.allclose(rows_sum, torch.ones(K), atol=0, rtol=0), "rounding left every row summing to 1: test proves nothing"

    # 2. The gateway judges against that q, normalized as multinomial normalizes it.
    judged: list[torch.Tensor] = []
    real_rejection_sample = speculative_step.rejection_sample

    def spy_rejection_sample(p: torch.Tensor, q: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        judged.append(q.clone())  # [batch, K_max, vocab]
        return real_rejection_sample(p, q, *args, **kwargs)

    monkeypatch.setattr(speculative_step, "rejection_sample", spy_rejection_sample)
    seq = Sequence(
        slot_id="s", prompt=PROMPT, sampling=sampling, max_new_tokens=16, num_speculative_tokens=K,
        detokenizer=StopStringDetokenizer.__new__(StopStringDetokenizer), generator=make_generator(1, "cpu"),
        draft_sampling=sampling, target_sampling=sampling,
    )
    target_logits = torch.randn(K + 1, wire.probs.shape[-1], generator=torch.Generator().manual_seed(0))  # [K+1, vocab]
    speculative_step.accept_all([seq], {"s": VerifiedChunk("s", len(PROMPT) + K + 1, logits=target_logits)}, {"s": wire})
    assert len(judged) == 1
    expected = drawn / drawn.sum(-1, keepdim=True)
    assert torch.equal(judged[0][0], expected)
    assert torch.equal(judged[0][0], sampled_distribution(wire.probs))
