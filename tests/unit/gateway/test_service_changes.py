"""What the gateway does with a restarted service's Info: adopt it or refuse it."""

from __future__ import annotations

import asyncio
import dataclasses

import torch

from specdec.gateway.kv_handoff import KVHandoff
from specdec.gateway.monitor import ServiceMonitor
from specdec.gateway.service_changes import ServiceChanges
from specdec.gateway.stats import GatewayStats
from specdec.wire.model_info import KVLayout, ModelInfo
from tests.support.fakes import FakeDraft, FakeTarget, model_info, scheduler


def changes(max_speculative_tokens: int = 8) -> ServiceChanges:
    sched = scheduler(FakeTarget(), FakeDraft(), decode_steps=4)
    info = model_info()
    return ServiceChanges(sched, info.tokenizer, max_speculative_tokens, info.max_seq_len, adaptive_k=True)


def test_a_service_allowing_less_than_the_promised_k_is_refused_target_and_draft_alike() -> None:
    """The gateway promised K up to 8 (and multi-step plain rounds within it): a service that
    comes back allowing less would fail those calls, so it is refused until it allows them."""
    watcher = changes()
    smaller = dataclasses.replace(model_info(), max_speculative_tokens=4)
    for name in ("target", "draft"):
        reason = watcher(name, smaller)
        assert reason is not None and "K up to 4" in reason and "promises 8" in reason
    assert watcher.scheduler.draft_refused
    assert watcher("target", model_info()) is None
    assert watcher("draft", model_info()) is None and not watcher.scheduler.draft_refused


def test_a_service_with_a_shorter_context_or_another_tokenizer_is_refused() -> None:
    watcher = changes()
    shorter = dataclasses.replace(model_info(), max_seq_len=model_info().max_seq_len - 1)
    assert "context holds" in (watcher("target", shorter) or "")
    other = dataclasses.replace(model_info(),
                                tokenizer=dataclasses.replace(model_info().tokenizer, fingerprint="0" * 64))
    assert "tokenizer" in (watcher("target", other) or "")


def test_the_kv_handoff_follows_the_services_layouts() -> None:
    """A draft that comes back as another model's takes the target's keys and values no more;
    once it is the target's own weights again, it does. Without --kv-handoff, never."""
    own = dataclasses.replace(model_info(), kv_layout=KVLayout("weights", 30, 3, 64))
    other = dataclasses.replace(own, kv_layout=KVLayout("other weights", 30, 3, 64))
    watcher = changes()
    watcher.kv_handoff, watcher.adopted = True, {"target": own, "draft": own}
    assert watcher("draft", other) is None and watcher.scheduler.planner.kv_handoff is None
    assert watcher("draft", own) is None
    assert watcher.scheduler.planner.kv_handoff == KVHandoff(30, torch.float32)
    assert watcher("target", other) is None and watcher.scheduler.planner.kv_handoff is None
    switched_off = changes()
    assert switched_off("draft", own) is None and switched_off.scheduler.planner.kv_handoff is None


def test_a_service_back_with_other_weights_alone_is_a_change() -> None:
    """The same name, dtype and costs, but other weights (a new file under the same path):
    the monitor hands the Info on, so the handoff is weighed afresh."""
    own = dataclasses.replace(model_info(), kv_layout=KVLayout("weights", 30, 3, 64))
    draft = FakeDraft()
    monitor = ServiceMonitor({"draft": draft}, {"draft": own}, GatewayStats(max_speculative_tokens=8))
    seen: list[ModelInfo] = []

    def adopt(name: str, info: ModelInfo) -> None:
        seen.append(info)

    monitor.on_change = adopt
    other = dataclasses.replace(own, kv_layout=KVLayout("new weights", 30, 3, 64))
    draft.info = lambda timeout=0.0: _answer(other)  # type: ignore[method-assign]
    asyncio.run(monitor.poll("draft"))
    assert seen == [other] and monitor.latest["draft"] == other


async def _answer(info: ModelInfo) -> ModelInfo:
    return info


def test_a_draft_with_a_new_cost_table_keeps_its_acceptance_and_another_model_does_not() -> None:
    """Costs timed again (the draft's compiled steps loaded) or a restart of the same model leave
    what the planner learnt of its tokens; another model, quantization or layer count drafts
    other tokens, so its acceptance is learnt afresh."""
    from specdec.cost_model import ForwardCost

    watcher = changes()
    planner = watcher.scheduler.planner
    same = model_info()
    watcher.adopted["draft"] = same
    planner.acceptance.observe("slot", 8, 0, now=0.0)
    judged = planner.acceptance.overall.alpha
    retimed = dataclasses.replace(same, forward_costs=(ForwardCost(1, 1, 0.01), ForwardCost(1, 2, 0.012)))
    assert watcher("draft", retimed) is None
    assert planner.acceptance.measured and planner.acceptance.overall.alpha == judged
    assert planner.costs.draft is not None and planner.costs.draft.step(1) == 0.01
    fewer_layers = dataclasses.replace(retimed, kv_layout=KVLayout("weights", 2, 3, 64))
    assert watcher("draft", fewer_layers) is None
    assert not planner.acceptance.measured and planner.acceptance.overall.alpha == planner.acceptance.prior_alpha
