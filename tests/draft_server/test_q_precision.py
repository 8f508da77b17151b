"""q on the wire in bf16, its tail cut: the draft samples from exactly the rows it sends, and
the gateway (q_i(t_i)) and the target (q_i for the residual) judge its tokens against exactly
that distribution. Deterministic: the tensors are compared bit for bit, no statistics."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from specdec.draft_server import engine as draft_engine_module
from specdec.draft_server.config import DraftConfig
from specdec.draft_server.engine import DraftEngine
from specdec.model.runtime import ModelRuntime
from specdec.sampling.params import SamplingParams
from specdec.wire.items import Proposal, ProposeItem

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
    wire = Proposal.from_pb(proposal.to_pb())  # what the gateway receives and forwards to the target
    assert wire.probs is not None and wire.probs.values.dtype == torch.bfloat16 and wire.probs.num_rows == K

    # 1. The draft drew each token from the rounded, cut q itself: its rows are the wire's
    #    values at the wire's tokens, and zero elsewhere.
    drawn = torch.cat(sampled_from)  # [K, vocab], one row per drafting step
    vocab = drawn.shape[-1]
    sent = torch.zeros(K, vocab)
    rows = torch.repeat_interleave(torch.arange(K), torch.tensor(wire.probs.lengths))
    sent[rows, wire.probs.token_ids] = wire.probs.values.float()
    assert torch.equal(drawn, sent)
    assert not torch.allclose(drawn.sum(-1), torch.ones(K), atol=0, rtol=0), "rows sum to 1: the test proves nothing"

    # 2. The target's q rows and the gateway's q_i(t_i) are one computation of that q, normalized.
    q = wire.probs.distributions(vocab, extra_rows=1)  # [K+1, vocab], the target's
    assert torch.equal(q[K], torch.zeros(vocab))  # the bonus position has no q
    torch.testing.assert_close(q[:K], drawn / drawn.sum(-1, keepdim=True), atol=0, rtol=1e-6)
    judged = wire.probs.probs_of(wire.tokens)  # [K], the gateway's
    assert torch.equal(judged, q[torch.arange(K), torch.tensor(wire.tokens)])
    assert (judged > 0).all()
