"""c measured side by side: 1-token draft and target steps, alternated through the running services.

Each service times its forward at start-up (`ModelInfo.forward_costs`), but they start one
after the other, ~40 s apart, and a shared 2-core VM drifts by ±30 % over such spans: the
start-up c of three runs on one machine came out at 0.305, 0.340 and 0.396. Here the bench
calls the services directly, a draft step and a target step in turn, on a scratch slot
with a short chat-sized context, and takes the compute seconds each service reports
(`compute_s`). A pair's two steps are a few milliseconds apart, so drift cancels in their
ratio. The probes run while the stack idles, between W1's repetitions, so they sample the
machine over the same minutes as the speedup they explain.

A draft step is a Propose of K = 1 fed one token: one forward and its argmax, exactly one
step of the drafting loop. A target step is a Verify of one token, argmax only: one
forward, exactly one plain decoding step. Each call rolls the slot back to the context
first, so every pair times the same positions.
"""

from __future__ import annotations

import statistics
import uuid
from dataclasses import dataclass

import grpc

from specdec.model.cost_profile import filler_prompt
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

#: Cached tokens of the scratch slot (a chat prompt and some output, as W1's requests have).
CONTEXT_LEN = 96
#: Draft/target step pairs per probe; a probe takes about PAIRS × 25 ms.
PAIRS = 12
#: Deadline of each call to a service.
CALL_TIMEOUT_S = 60.0


@dataclass
class StepPair:
    """One draft step and the target step right after it, compute seconds each."""

    draft_s: float
    target_s: float
    #: Which probe of the run it came from (0, 1, ...).
    probe: int = 0

    @property
    def c(self) -> float:
        return self.draft_s / self.target_s


def probe_steps(target_address: str, draft_address: str, vocab_size: int, probe: int = 0, pairs: int = PAIRS) -> list[StepPair]:
    """Time `pairs` alternating 1-token draft and target steps on scratch slots (released after)."""
    slot = f"bench-steps-{uuid.uuid4().hex}"
    prompt = filler_prompt(vocab_size, CONTEXT_LEN + 1)
    context, token = prompt[:CONTEXT_LEN], prompt[CONTEXT_LEN]
    greedy = common_pb2.SamplingParams()
    with grpc.insecure_channel(target_address) as target_channel, grpc.insecure_channel(draft_address) as draft_channel:
        target = target_pb2_grpc.TargetServiceStub(target_channel)
        draft = draft_pb2_grpc.DraftServiceStub(draft_channel)

        def target_step() -> float:
            item = target_pb2.VerifyItem(slot_id=slot, valid_len=CONTEXT_LEN, tokens=[token], argmax_only=True)
            return float(target.Verify(target_pb2.VerifyRequest(items=[item]), timeout=CALL_TIMEOUT_S).compute_s)

        def draft_step(valid_len: int, tokens: list[int]) -> float:
            item = draft_pb2.ProposeItem(slot_id=slot, valid_len=valid_len, new_tokens=tokens, num_speculative_tokens=1,
                                         sampling=greedy)
            return float(draft.Propose(draft_pb2.ProposeRequest(items=[item]), timeout=CALL_TIMEOUT_S).compute_s)

        target.Prefill(target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(slot_id=slot, prompt_tokens=context)]),
                       timeout=CALL_TIMEOUT_S)
        try:
            draft_step(0, context)  # the draft's own prefill of the context
            try:
                target_step()  # one untimed pair: first-call costs stay out
                draft_step(CONTEXT_LEN, [token])
                return [StepPair(draft_step(CONTEXT_LEN, [token]), target_step(), probe) for _ in range(pairs)]
            finally:
                draft.Release(common_pb2.ReleaseRequest(slot_id=slot), timeout=CALL_TIMEOUT_S)
        finally:
            target.Release(common_pb2.ReleaseRequest(slot_id=slot), timeout=CALL_TIMEOUT_S)


def side_by_side_c(pairs: list[StepPair]) -> tuple[float, float, float]:
    """(c, median draft step s, median target step s): c is the median of the pairs' ratios."""
    if not pairs:
        return float("nan"), float("nan"), float("nan")
    return (
        statistics.median(p.c for p in pairs),
        statistics.median(p.draft_s for p in pairs),
        statistics.median(p.target_s for p in pairs),
    )
