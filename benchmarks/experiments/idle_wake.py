"""What a model service's call costs after its process sat idle, against the same call back to back.

    .venv/bin/python benchmarks/experiments/idle_wake.py [--repeats 25] [service flags, e.g. --no-release-threads]

Starts `target_server` and then `draft_server` (one after the other, so neither times its
start-up while the other loads), fills one slot in each with a 100-token prompt, and
reports the median compute seconds the services themselves measure (`compute_s`) of a
1-step Propose and a 1-step Verify: back to back, right after the other service's call,
and after the process idled for 5 or 40 ms. In a speculative round every call follows the
other service's turn, so what the "after" rows add over "back to back" is paid twice a
round on top of the pure step costs that Theorem 3.8's expected speedup counts.
Extra arguments are passed to both services.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import grpc

from specdec.cli.launcher import start_service
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specdec.wire.limits import message_size_options

PROMPT = list(range(1000, 1100))  # 100 in-vocabulary token ids
GREEDY = common_pb2.SamplingParams(temperature=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=25)
    args, service_flags = parser.parse_known_args()
    target_proc = start_service("specdec.target_server", service_flags)
    target_proc.wait_ready()
    draft_proc = start_service("specdec.draft_server", service_flags)
    draft_proc.wait_ready()
    try:
        options = message_size_options()
        target = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(target_proc.address, options=options))
        draft = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(draft_proc.address, options=options))
        target.Prefill(target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(slot_id="t", prompt_tokens=PROMPT)]))
        draft.Propose(draft_pb2.ProposeRequest(items=[draft_pb2.ProposeItem(
            slot_id="d", valid_len=0, new_tokens=PROMPT, num_speculative_tokens=1, sampling=GREEDY)]))
        n = len(PROMPT)

        def propose(k: int = 1) -> float:
            item = draft_pb2.ProposeItem(slot_id="d", valid_len=n, new_tokens=[7], num_speculative_tokens=k,
                                         sampling=GREEDY)
            return draft.Propose(draft_pb2.ProposeRequest(items=[item])).compute_s

        def verify() -> float:
            item = target_pb2.VerifyItem(slot_id="t", valid_len=n, tokens=[7],
                                         mode=target_pb2.VerifyMode(argmax=target_pb2.VerifyMode.Argmax()))
            return target.Verify(target_pb2.VerifyRequest(items=[item])).compute_s

        def after(first: Callable[[], object], call: Callable[[], float]) -> Callable[[], float]:
            return lambda: (first(), call())[1]

        for _ in range(5):
            propose(), verify()
        cases: list[tuple[str, Callable[[], float]]] = [
            ("draft, back to back", propose),
            ("draft, after a target step", after(verify, propose)),
            ("draft, after 5 ms idle", after(lambda: time.sleep(0.005), propose)),
            ("draft, after 40 ms idle", after(lambda: time.sleep(0.04), propose)),
            ("target, back to back", verify),
            ("target, after a K = 8 Propose", after(lambda: propose(8), verify)),
            ("target, after 40 ms idle", after(lambda: time.sleep(0.04), verify)),
        ]
        print(f"{'1-step call':32s} {'median ms':>9s}  min-max")
        for name, case in cases:
            ms = [1e3 * case() for _ in range(args.repeats)]
            print(f"{name:32s} {statistics.median(ms):9.2f}  {min(ms):.2f}-{max(ms):.2f}", flush=True)
    finally:
        draft_proc.stop()
        target_proc.stop()


if __name__ == "__main__":
    main()
