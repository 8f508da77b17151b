"""--batch-invariant on the target engine: verify and decode steps run in one fixed shape, so a
verified chunk's logits are the bits the same tokens get when decoded one at a time."""

from __future__ import annotations

import pytest
import torch

from specdec.model.runtime import build_runtime
from specdec.target_server.config import TargetConfig
from specdec.target_server.engine import TargetEngine
from specdec.wire.items import LogitsMode, PrefillItem, VerifiedLogits, VerifyItem

PROMPT = [128000, 791, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679]
DRAFT = [1174, 323, 279, 4062]


@pytest.fixture(scope="module")
def engine(every_core: int) -> TargetEngine:
    runtime = build_runtime("random:llama-3.2-1b:seed=5", num_layers=1)
    config = TargetConfig(
        batch_invariant=True, invariant_batch=2, max_speculative_tokens=4, kv_token_budget=256,
        max_slots=4, measure_costs=False,
    )
    return TargetEngine(runtime, config)


def _logits(engine: TargetEngine, items: list[VerifyItem]) -> list[torch.Tensor]:
    return [answer.logits for answer in engine.verify(items) if isinstance(answer, VerifiedLogits)]


def test_a_verified_chunk_has_the_bits_of_its_tokens_decoded_one_at_a_time(engine: TargetEngine) -> None:
    # K + 1 = 5 tokens a chunk, or more where this machine's matmuls would treat rows unalike.
    assert engine.step_shape is not None and 5 <= engine.step_shape.tokens <= 10
    engine.prefill([PrefillItem("plain", PROMPT), PrefillItem("spec", PROMPT), PrefillItem("other", PROMPT[:4])])
    decoded = []
    for step, token in enumerate(DRAFT):  # alone, then beside another request
        start = len(PROMPT) + step
        items = [VerifyItem("plain", start, [token], LogitsMode())]
        if step % 2:
            items.insert(0, VerifyItem("other", 4 + step // 2, [step], LogitsMode()))
        decoded.append(_logits(engine, items)[-1])
    verified = _logits(engine, [VerifyItem("other", 6, [7, 8], LogitsMode()),
                                VerifyItem("spec", len(PROMPT), DRAFT, LogitsMode())])[-1]  # [K+1, vocab]
    assert torch.equal(verified, torch.cat(decoded))
    choices = {choice.name: choice.value for choice in engine.tuner.choices}
    assert choices["batch_invariant"] == "True" and choices["invariant_step_tokens"] == str(engine.step_shape.tokens)
