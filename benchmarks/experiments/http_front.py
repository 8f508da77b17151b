"""What the OpenAI-compatible HTTP front costs beside gRPC `Generate`, side by side in one run.

    .venv/bin/python benchmarks/experiments/http_front.py [--repetitions 6] [--rounds 2]

Starts target, draft and a gateway with `--http-port 0` as subprocesses (the embedded pair;
the draft eager, so no compilation runs in the background while measuring), then, alternating
the two fronts so drift in the machine's speed hits both alike:
* one greedy 128-token streamed chat request at a time: the wall time from sending to the last
  byte (gRPC `Generate` with grpc.aio; `POST /v1/chat/completions` with `stream: true` and aiohttp);
* 16 such streams at once: aggregate completion tokens per second.
Both fronts get the same prompt and settings, so they generate the same tokens. Prints the
medians and the HTTP / gRPC ratios with the CPU model, and the gateway process's CPU time per
token by front (what the front itself costs, less sensitive than wall time to other work
on shared cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable

import aiohttp
import grpc

from specdec.cli.launcher import ServiceProcess, start_service
from specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from specdec_bench.results import cpu_model

PROMPT = "Tell me a long story about a dragon and a knight who become friends."
MAX_TOKENS = 128
CONCURRENCY = 16
#: One request: its completion tokens.
Request = Callable[[], Awaitable[int]]


def grpc_request(stub: gateway_pb2_grpc.GatewayStub) -> Request:
    message = gateway_pb2.GenerateRequest(
        chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content=PROMPT)]),
        max_new_tokens=MAX_TOKENS, sampling=common_pb2.SamplingParams(temperature=0.0))

    async def run() -> int:
        tokens = 0
        async for response in stub.Generate(message):
            if response.HasField("completion"):
                tokens = response.completion.usage.completion_tokens
        return tokens

    return run


def http_request(session: aiohttp.ClientSession, url: str) -> Request:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}

    async def run() -> int:
        tokens = 0
        async with session.post(url, json=body) as reply:
            async for line in reply.content:
                if line.startswith(b"data: {") and b'"usage":{' in line:
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
        return tokens

    return run


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (Linux)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def timed(requests: list[Request], pid: int) -> tuple[float, int, float]:
    """Wall seconds, completion tokens, and the gateway's CPU seconds of running `requests` at once."""
    cpu, start = cpu_seconds(pid), time.perf_counter()
    tokens = await asyncio.gather(*(request() for request in requests))
    return time.perf_counter() - start, sum(tokens), cpu_seconds(pid) - cpu


async def measure(gateway: ServiceProcess, repetitions: int, rounds: int) -> None:
    assert gateway.ready is not None and gateway.ready.http_port is not None
    url = f"http://127.0.0.1:{gateway.ready.http_port}/v1/chat/completions"
    pid = gateway.process.pid
    async with grpc.aio.insecure_channel(gateway.address) as channel, aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=CONCURRENCY)
    ) as session:
        fronts = {"grpc": grpc_request(gateway_pb2_grpc.GatewayStub(channel)),
                  "http": http_request(session, url)}
        for name, request in fronts.items():  # warm-up: first-use costs of both paths
            print(f"{name}: {await request()} completion tokens a request")
        single = await interleaved(fronts, 1, repetitions, pid)
        crowd = await interleaved(fronts, CONCURRENCY, rounds, pid)
    print(f"CPU: {cpu_model()} (shared machine: other work may run beside)")
    report(f"one {MAX_TOKENS}-token stream", single, lambda wall, tokens: wall, "s wall")
    report(f"{CONCURRENCY} concurrent streams", crowd, lambda wall, tokens: tokens / wall, "tok/s")


async def interleaved(fronts: dict[str, Request], streams: int, repetitions: int,
                      pid: int) -> dict[str, list[tuple[float, int, float]]]:
    """`repetitions` runs of `streams` requests at once per front, the fronts' order alternating."""
    runs: dict[str, list[tuple[float, int, float]]] = {name: [] for name in fronts}
    for repetition in range(repetitions):
        for name in list(fronts) if repetition % 2 == 0 else list(reversed(fronts)):
            runs[name].append(await timed([fronts[name]] * streams, pid))
    return runs


def report(title: str, runs: dict[str, list[tuple[float, int, float]]],
           figure: Callable[[float, int], float], unit: str) -> None:
    print(f"{title}, medians of {len(runs['grpc'])}:")
    medians, cpu = {}, {}
    for name, samples in runs.items():
        values = [figure(wall, tokens) for wall, tokens, _ in samples]
        medians[name] = statistics.median(values)
        # Summed: the CPU clock ticks in 10 ms, too coarse for one request.
        cpu[name] = sum(gateway_cpu for *_, gateway_cpu in samples) * 1000 / sum(tokens for _, tokens, _ in samples)
        print(f"  {name:<5}{medians[name]:9.3f} {unit} (all: {', '.join(f'{v:.3f}' for v in values)}); "
              f"gateway CPU {cpu[name]:.3f} ms a token (all runs)")
    print(f"  http / grpc: {medians['http'] / medians['grpc']:.3f} {unit}, {cpu['http'] / cpu['grpc']:.3f} gateway CPU")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=6, help="single-stream runs per front")
    parser.add_argument("--rounds", type=int, default=2, help=f"{CONCURRENCY}-stream runs per front")
    args = parser.parse_args()
    services = [start_service("specdec.target_server")]
    services[0].wait_ready()
    services.append(start_service("specdec.draft_server", ["--compile", "off"]))
    services[1].wait_ready()
    try:
        services.append(start_service("specdec.gateway", [
            "--target-address", services[0].address, "--draft-address", services[1].address, "--http-port", "0",
            # Without it, every repetition of the one prompt would copy the answer from the last.
            "--suffix-cache-tokens", "0",
        ], ready_name="gateway"))
        asyncio.run(measure(services[2].wait_ready(), args.repetitions, args.rounds))
    finally:
        for service in reversed(services):
            service.stop()


if __name__ == "__main__":
    main()
