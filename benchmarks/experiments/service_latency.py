"""Per-call latency of the model services over real gRPC, one request, side by side.

    .venv/bin/python benchmarks/experiments/service_latency.py [--iterations 20]

Starts `target_server` (fp32) and `draft_server` (int8, bf16) as subprocesses and times
Verify with K=0 and K=4 and Propose with k=4 for a single request at a ~40-token
context, plus the wire size of a Propose reply (greedy and sampled).
"""

from __future__ import annotations

import argparse
import statistics
import time

import grpc

from specdec.cli.launcher import start_service
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specdec.wire.limits import message_size_options

PROMPT = list(range(1000, 1040))  # 40 in-vocabulary token ids


def _channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=message_size_options())


def _time(fn, iterations: int) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm-up
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    target_proc, draft_proc = start_service("specdec.target_server"), start_service("specdec.draft_server")
    target_proc.wait_ready(), draft_proc.wait_ready()
    try:
        target = target_pb2_grpc.TargetServiceStub(_channel(target_proc.address))
        draft = draft_pb2_grpc.DraftServiceStub(_channel(draft_proc.address))
        target.Prefill(target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(slot_id="b", prompt_tokens=PROMPT)]))
        n = len(PROMPT)

        def verify(k: int):  # type: ignore[no-untyped-def]
            return lambda: target.Verify(target_pb2.VerifyRequest(
                items=[target_pb2.VerifyItem(slot_id="b", valid_len=n, tokens=[7] * (k + 1))]))

        def propose(temperature: float):  # type: ignore[no-untyped-def]
            item = draft_pb2.ProposeItem(slot_id=f"d{temperature}", valid_len=0, new_tokens=PROMPT,
                                         num_speculative_tokens=4,
                                         sampling=common_pb2.SamplingParams(temperature=temperature, seed=1))
            draft.Propose(draft_pb2.ProposeRequest(items=[item]))
            item.valid_len, item.new_tokens[:] = n, [7]
            return lambda: draft.Propose(draft_pb2.ProposeRequest(items=[item]))

        rows = [
            ("Verify K=0", _time(verify(0), args.iterations)),
            ("Verify K=4", _time(verify(4), args.iterations)),
            ("Propose k=4 greedy", _time(propose(0.0), args.iterations)),
            ("Propose k=4 sampled", _time(propose(1.0), args.iterations)),
        ]
        for name, ms in rows:
            print(f"{name:<22}{ms:8.1f} ms")
        greedy = propose(0.0)().ByteSize()
        sampled = propose(1.0)().ByteSize()
        print(f"Propose reply size: greedy {greedy} B, sampled (4 fp32 q rows) {sampled / 1024:.0f} KiB")
    finally:
        draft_proc.stop()
        target_proc.stop()


if __name__ == "__main__":
    main()
