"""What a call to a model service costs the gateway beyond the service's compute: a unary
call against a message on the kept stream (`--no-streamed-calls` against the default).

    .venv/bin/python benchmarks/experiments/call_overhead.py [--calls 75]

Starts the default target and draft services and drives them with the gateway's own
clients, one with unary calls and one with kept streams, alternating call by call: a
Propose drafting one token and a Verify of two tokens (argmax), a speculative round at
K = 1 for one request. Prints the median and p90 of wall − compute per call and client.

Then the floor under those figures: a bare grpcio echo service in another process, whose
handler hands each message to a worker thread as the services do and keeps it there for
as long as the services' median compute (torch matmuls on two threads, so the cores are
as busy as in a forward), answered on a kept stream with nothing else in the message. Its
wall − compute is what the machine's gRPC, event loops and thread wake-ups cost with no
code of ours in the path.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.queues import Queue

import grpc
import torch

from specdec.cli.launcher import start_service
from specdec.gateway.model_clients import DraftClient, ServiceLink, TargetClient
from specdec.sampling.params import SamplingParams
from specdec.tuning.cost_profile import filler_prompt
from specdec.v1 import common_pb2
from specdec.wire.items import ArgmaxMode, Lease, PrefillItem, ProposeItem, VerifyItem
from specdec.wire.limits import DEFAULT_MAX_MESSAGE_BYTES

SERVICE_ARGS = ["--log-level", "WARNING", "--no-prefix-caching"]
CONTEXT = 96
TIMEOUT_S = 60.0
WARM_UP = 5


async def measure(
    target_address: str, draft_address: str, calls: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """wall − compute per call and client, and the services' compute seconds per rpc."""
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
    compute: dict[str, list[float]] = {"Propose": [], "Verify": []}
    try:
        for i in range(WARM_UP + calls):
            for name in (("unary", "stream") if i % 2 == 0 else ("stream", "unary")):
                target, draft = clients[name]
                # The same round each time: both slots roll back to where they were.
                proposed = await draft.propose([ProposeItem("s", CONTEXT - 1, [prompt[CONTEXT - 1]], 1, greedy)],
                                               TIMEOUT_S)
                verified = await target.verify([VerifyItem("s", CONTEXT, prompt[CONTEXT:CONTEXT + 2], ArgmaxMode())],
                                               TIMEOUT_S)
                if i >= WARM_UP:
                    overhead.setdefault(f"Propose, {name}", []).append(proposed.wall_s - proposed.compute_s)
                    overhead.setdefault(f"Verify, {name}", []).append(verified.wall_s - verified.compute_s)
                    compute["Propose"].append(proposed.compute_s)
                    compute["Verify"].append(verified.compute_s)
    finally:
        for target, draft in clients.values():
            await target.close()
            await draft.close()
    return overhead, compute


ECHO_METHOD = "/callfloor.Echo/Hold"
#: The echo's request and answer: a float64 of seconds (to hold the worker, then held).
SECONDS = struct.Struct("<d")


def hold(seconds: float, work: torch.Tensor) -> float:
    """Keep the calling thread computing for about `seconds`; returns the seconds it took."""
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        work @ work
    return time.perf_counter() - started


async def serve_echo(port_queue: Queue[int]) -> None:
    worker = ThreadPoolExecutor(max_workers=1)
    work = torch.randn(256, 256)

    async def answer(requests: object, context: grpc.aio.ServicerContext) -> None:
        while (request := await context.read()) is not grpc.aio.EOF:
            seconds = SECONDS.unpack(request)[0]
            held = await asyncio.get_running_loop().run_in_executor(worker, hold, seconds, work)
            await context.write(SECONDS.pack(held))

    server = grpc.aio.server()
    handler: grpc.RpcMethodHandler[bytes, bytes] = grpc.stream_stream_rpc_method_handler(answer)
    service, method = ECHO_METHOD.strip("/").split("/")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {method: handler}),))
    port_queue.put(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    await server.wait_for_termination()


def run_echo(port_queue: Queue[int]) -> None:
    torch.set_num_threads(2)
    asyncio.run(serve_echo(port_queue))


async def echo_overhead(port: int, compute_s: dict[str, float], calls: int) -> dict[str, list[float]]:
    """wall − compute per echo, holding the worker as long as each call's compute."""
    overhead: dict[str, list[float]] = {}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stream: grpc.aio.StreamStreamCall[bytes, bytes] = channel.stream_stream(ECHO_METHOD)()
        for i in range(WARM_UP + calls):
            for name, seconds in compute_s.items():
                started = time.perf_counter()
                await stream.write(SECONDS.pack(seconds))
                answer = await stream.read()
                assert isinstance(answer, bytes), "the echo service ended the stream"
                held = SECONDS.unpack(answer)[0]
                if i >= WARM_UP:
                    overhead.setdefault(f"{name}, echo", []).append(time.perf_counter() - started - held)
        await stream.done_writing()
    return overhead


def echo_floor(compute_s: dict[str, float], calls: int) -> dict[str, list[float]]:
    """`echo_overhead` against an echo service in a child process."""
    context = multiprocessing.get_context("spawn")
    ports: Queue[int] = context.Queue()
    child = context.Process(target=run_echo, args=(ports,), daemon=True)
    child.start()
    try:
        return asyncio.run(echo_overhead(ports.get(timeout=60), compute_s, calls))
    finally:
        child.kill()
        child.join()


def report(title: str, overhead: dict[str, list[float]]) -> None:
    print(title)
    for name, samples in sorted(overhead.items()):
        p90 = sorted(samples)[int(0.9 * len(samples))]
        print(f"  {name:16s} median {statistics.median(samples) * 1e3:5.2f} ms   p90 {p90 * 1e3:5.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=75, help="calls per service and client")
    args = parser.parse_args()
    target = start_service("specdec.target_server", SERVICE_ARGS)
    draft = start_service("specdec.draft_server", SERVICE_ARGS)
    try:
        target.wait_ready(), draft.wait_ready()
        overhead, compute = asyncio.run(measure(target.address, draft.address, args.calls))
    finally:
        draft.stop()
        target.stop()
    median_compute = {name: statistics.median(seconds) for name, seconds in compute.items()}
    floor = echo_floor(median_compute, args.calls)
    report(f"wall − compute per call, {args.calls} calls each, alternating:", overhead)
    held = ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in median_compute.items())
    report(f"bare grpcio echo on a kept stream, worker held as long as the median compute ({held}):", floor)


if __name__ == "__main__":
    main()
