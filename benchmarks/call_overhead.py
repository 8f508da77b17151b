"""What a call to a model service costs the gateway beyond the service's compute: a unary
call against a message on the kept stream (`--no-streamed-calls` against the default).

    .venv/bin/python benchmarks/call_overhead.py [--calls 75]

Starts the default target and draft services and drives them with the gateway's own
clients, one with unary calls and one with kept streams, alternating call by call: a
Propose drafting one token and a Verify of two tokens (argmax), a speculative round at
K = 1 for one request. Prints the median and p90 of wall − compute per call and client.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from specdec.cli.launcher import start_service
from specdec.gateway.model_clients import DraftClient, ServiceLink, TargetClient
from specdec.model.cost_profile import filler_prompt
from specdec.sampling.params import SamplingParams
from specdec.v1 import common_pb2
from specdec.wire.items import Lease, PrefillItem, ProposeItem, VerifyItem
from specdec.wire.limits import DEFAULT_MAX_MESSAGE_BYTES

SERVICE_ARGS = ["--log-level", "WARNING", "--no-prefix-caching"]
CONTEXT = 96
TIMEOUT_S = 60.0
WARM_UP = 5


async def measure(target_address: str, draft_address: str, calls: int) -> dict[str, list[float]]:
    lease = Lease("call-overhead", "1")
    clients = {}
    for name, streamed in (("unary", False), ("stream", True)):
        link = ServiceLink(DEFAULT_MAX_MESSAGE_BYTES, streamed=streamed)
        clients[name] = (TargetClient(target_address, link, lease),
                         DraftClient(draft_address, link, common_pb2.DTYPE_FLOAT32, lease))
    target, draft = clients["unary"]
    prompt = filler_prompt((await target.info()).tokenizer.vocab_size, CONTEXT + 2)
    await target.prefill([PrefillItem("s", prompt[:CONTEXT])], TIMEOUT_S)
    greedy = SamplingParams(temperature=0.0)
    await draft.propose([ProposeItem("s", 0, prompt[:CONTEXT - 1], 1, greedy)], TIMEOUT_S)
    overhead: dict[str, list[float]] = {}
    try:
        for i in range(WARM_UP + calls):
            for name in (("unary", "stream") if i % 2 == 0 else ("stream", "unary")):
                target, draft = clients[name]
                # The same round each time: both slots roll back to where they were.
                proposed = await draft.propose([ProposeItem("s", CONTEXT - 1, [prompt[CONTEXT - 1]], 1, greedy)], TIMEOUT_S)
                verified = await target.verify([VerifyItem("s", CONTEXT, prompt[CONTEXT:CONTEXT + 2], argmax_only=True)],
                                               TIMEOUT_S)
                if i >= WARM_UP:
                    overhead.setdefault(f"Propose, {name}", []).append(proposed.wall_s - proposed.compute_s)
                    overhead.setdefault(f"Verify, {name}", []).append(verified.wall_s - verified.compute_s)
    finally:
        for target, draft in clients.values():
            await target.close()
            await draft.close()
    return overhead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=75, help="calls per service and client")
    args = parser.parse_args()
    target = start_service("specdec.target_server", SERVICE_ARGS)
    draft = start_service("specdec.draft_server", SERVICE_ARGS)
    try:
        target.wait_ready(), draft.wait_ready()
        overhead = asyncio.run(measure(target.address, draft.address, args.calls))
    finally:
        draft.stop()
        target.stop()
    print(f"wall − compute per call, {args.calls} calls each, alternating:")
    for name, samples in sorted(overhead.items()):
        p90 = sorted(samples)[int(0.9 * len(samples))]
        print(f"  {name:16s} median {statistics.median(samples) * 1e3:5.2f} ms   p90 {p90 * 1e3:5.2f} ms")


if __name__ == "__main__":
    main()
