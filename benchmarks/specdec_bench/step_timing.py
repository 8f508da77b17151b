"""c measured side by side: draft and target steps, alternated through the running services.

Each service times its forward at start-up (`ModelInfo.forward_costs`), but they start one
after the other, ~40 s apart, and a shared 2-core VM drifts by ±30 % over such spans: the
start-up c of three runs on one machine came out at 0.305, 0.340 and 0.396. Here the bench
calls the services directly, on a scratch slot with a short chat-sized context, the two
services in turn, and takes the compute seconds each reports (`compute_s`). A pair's calls
are a fraction of a second apart, so drift cancels in their ratio. The probes run while
the stack idles, between W1's repetitions, so they sample the machine over the same
minutes as the speedup they explain.

c is a ratio of steps as the drafting loop and plain decoding run them, back to back, so
each service is timed for a one-step call and a `STEPS`-step call, and the difference per
extra step is its step cost: a Propose of K = 1 against K = STEPS (one forward per drafted
token), a Verify of one token against one decoding STEPS tokens by itself (multi-step,
argmax). The one-step calls alone cost much more per step: the first forward after the
other service's turn starts a thread team and finds its caches cold (a draft step called
alone took 7-17 ms against ~5 ms inside a Propose, AMD EPYC Zen 5); the planner counts
that as the round's fixed overhead, not as c. The calls alternate between the services
(target 1, draft 1, target STEPS, draft STEPS), so both calls of a service start after the
other's turn, as in a round. Calling a service's two calls back to back gave the longer one a
warm start (AMD EPYC Zen 4, 12 probes of each order alternating): the draft's step came out
6.15 against 6.81 ms, the target's 36.4 against 36.5 ms, c 0.172 against 0.189. Each call rolls the
slot back to the context first, so every pair times the same positions.
"""

from __future__ import annotations

import statistics
import uuid
from dataclasses import dataclass

import grpc

from specdec.tuning.cost_profile import filler_prompt
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

#: Cached tokens of the scratch slot (a chat prompt and some output, as W1's requests have).
CONTEXT_LEN = 96
#: Steps of the longer call of each service.
STEPS = 5
#: Pairs per probe; a probe takes about PAIRS × 150 ms.
PAIRS = 8
#: Deadline of each call to a service.
CALL_TIMEOUT_S = 60.0


@dataclass
class StepPair:
    """Compute seconds of one-step and STEPS-step calls to each service, made in turn."""

    draft_one_s: float
    draft_many_s: float
    target_one_s: float
    target_many_s: float
    steps: int = STEPS
    #: Which probe of the run it came from (0, 1, ...).
    probe: int = 0

    @property
    def draft_step_s(self) -> float:
        return (self.draft_many_s - self.draft_one_s) / (self.steps - 1)

    @property
    def target_step_s(self) -> float:
        return (self.target_many_s - self.target_one_s) / (self.steps - 1)

    @property
    def c(self) -> float:
        return self.draft_step_s / self.target_step_s


def probe_steps(target_address: str, draft_address: str, vocab_size: int, probe: int = 0,
                pairs: int = PAIRS) -> list[StepPair]:
    """Time `pairs` rounds of draft and target calls in turn on a scratch slot (released after)."""
    slot = f"bench-steps-{uuid.uuid4().hex}"
    prompt = filler_prompt(vocab_size, CONTEXT_LEN + 1)
    context, token = prompt[:CONTEXT_LEN], prompt[CONTEXT_LEN]
    greedy = common_pb2.SamplingParams()
    with grpc.insecure_channel(target_address) as target_channel, grpc.insecure_channel(draft_address) as draft_channel:
        target = target_pb2_grpc.TargetServiceStub(target_channel)
        draft = draft_pb2_grpc.DraftServiceStub(draft_channel)

        def target_call(steps: int) -> float:
            mode = target_pb2.VerifyMode(decode=target_pb2.VerifyMode.Decode(steps=steps))
            item = target_pb2.VerifyItem(slot_id=slot, valid_len=CONTEXT_LEN, tokens=[token], mode=mode)
            return float(target.Verify(target_pb2.VerifyRequest(items=[item]), timeout=CALL_TIMEOUT_S).compute_s)

        def draft_call(k: int, valid_len: int = CONTEXT_LEN, tokens: list[int] | None = None) -> float:
            item = draft_pb2.ProposeItem(slot_id=slot, valid_len=valid_len, new_tokens=tokens or [token],
                                         num_speculative_tokens=k, sampling=greedy)
            return float(draft.Propose(draft_pb2.ProposeRequest(items=[item]), timeout=CALL_TIMEOUT_S).compute_s)

        target.Prefill(target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(slot_id=slot, prompt_tokens=context)]),
                       timeout=CALL_TIMEOUT_S)
        try:
            draft_call(1, 0, context)  # the draft's own prefill of the context
            try:
                target_call(STEPS)  # one untimed round: first-call costs stay out
                draft_call(STEPS)

                def one_pair() -> StepPair:
                    # In turns, as in a round: each call follows the other service's call, so
                    # the one-step and the STEPS-step call of a service start alike (caches
                    # just filled by the other model, a new thread team) and their difference
                    # is steps only.
                    target_one = target_call(1)
                    draft_one = draft_call(1)
                    target_many = target_call(STEPS)
                    draft_many = draft_call(STEPS)
                    return StepPair(draft_one, draft_many, target_one, target_many, STEPS, probe)

                return [one_pair() for _ in range(pairs)]
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
        statistics.median(p.draft_step_s for p in pairs),
        statistics.median(p.target_step_s for p in pairs),
    )
