"""Two gateways on one target/draft pair behind a real load balancer (HAProxy), under load:
what clients lose when one gateway drains, and when the target is killed and restarted.

    python -m specdec_bench.balancer                  # make balancer: 16 streams of 200 tokens
    python -m specdec_bench.balancer --streams 8 --tokens 64

HAProxy speaks HTTP/2 to both sides, balances each gRPC call (not each connection) to the
gateway with the fewest streams, and health-checks each gateway's HTTP `/health` (503 while it
drains or its target is away). Clients are `SpecdecClient`s, whose channel retries a call
refused before its first token (`specdec.client.RETRY_POLICY`). Two phases:

* **drain**: `streams` clients send greedy requests back to back; one gateway gets SIGTERM
  partway through and drains; clients keep sending until it has exited. Counted: requests
  that failed (lost), whether every answer equals plain decoding, and how long the gateway
  took to exit.
* **target restart**: the target is killed (SIGKILL) under load and restarted on its port by
  this script, as a supervisor would; counted: requests lost, and the first token after the
  restarted target answers.

`tests/gateway/test_balancer.py` runs a short drain. Needs `haproxy` (Debian's package; `make
test` installs it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from specdec.cli.launcher import ServiceProcess, start_service
from specdec.client import SpecdecClient
from specdec_bench.results import cpu_model
from specdec_bench.stack import Stack, running_stack, second_gateway
from specdec_bench.workloads import PROMPTS, chat

#: What each gateway runs with: an HTTP port for the health check, a drain long enough for
#: every stream, and greedy requests drafted by the model alone.
GATEWAY_ARGS = "--http-port 0 --drain-timeout-s 300"
QUIET = ("--log-level", "WARNING")


@dataclass(frozen=True)
class Backend:
    """A gateway as HAProxy sees it: its gRPC port, and the HTTP port of its health check."""

    grpc_port: int
    http_port: int

    @classmethod
    def of(cls, gateway: ServiceProcess) -> Backend:
        assert gateway.ready is not None and gateway.ready.http_port is not None, "the gateway serves no HTTP port"
        return cls(int(gateway.address.rsplit(":", 1)[1]), gateway.ready.http_port)


def haproxy_config(port: int, backends: Sequence[Backend]) -> str:
    """h2c in front and behind; a gateway is out after one failed check (one every 500 ms, each
    allowed 2 s: a busy gateway answers late, not wrongly) and back after two; each call goes to
    the gateway with the fewest in flight."""
    servers = "\n".join(f"    server g{i} 127.0.0.1:{b.grpc_port} proto h2 check port {b.http_port} check-proto h1"
                        for i, b in enumerate(backends))
    return f"""global
    maxconn 2048
defaults
    mode http
    timeout connect 2s
    timeout check 2s
    timeout client 900s
    timeout server 900s
frontend specdec
    bind 127.0.0.1:{port} proto h2
    default_backend gateways
backend gateways
    balance leastconn
    option httpchk GET /health
    http-check expect status 200
    default-server inter 500ms fastinter 250ms downinter 500ms fall 1 rise 2
{servers}
"""


def haproxy_binary() -> str | None:
    """Debian installs it in /usr/sbin, which a user's PATH may not name."""
    return shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def running_haproxy(backends: Sequence[Backend], timeout: float = 30.0) -> Iterator[str]:
    """HAProxy in front of `backends`; yields its address once it accepts connections."""
    binary = haproxy_binary()
    if binary is None:
        raise RuntimeError("haproxy is not installed (Debian: apt-get install haproxy; make test installs it)")
    port = free_port()
    with tempfile.TemporaryDirectory() as directory:
        config = Path(directory) / "haproxy.cfg"
        config.write_text(haproxy_config(port, backends))
        process = subprocess.Popen([binary, "-db", "-f", str(config)], stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("haproxy did not start") from None
                    time.sleep(0.1)
            yield f"127.0.0.1:{port}"
        finally:
            process.terminate()
            process.wait(10)


@dataclass
class Outcome:
    """One request as its client saw it."""

    prompt: int
    sent: float
    tokens: list[int] = field(default_factory=list)
    #: When each response with tokens arrived.
    arrivals: list[float] = field(default_factory=list)
    ended: float = 0.0
    error: str | None = None


class Load:
    """`streams` clients sending greedy requests of `tokens` tokens back to back through
    `address`, cycling through the first `prompts` prompts, until `stop`."""

    def __init__(self, address: str, streams: int, tokens: int, prompts: int = len(PROMPTS)) -> None:
        self.address, self.tokens, self.prompts = address, tokens, prompts
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(streams)]
        for thread in self._threads:
            thread.start()

    def _client(self, index: int) -> None:
        with SpecdecClient(self.address, timeout=900) as client:
            turn = 0
            while not self._stop.is_set():
                outcome = Outcome((index + turn) % self.prompts, time.monotonic())
                turn += 1
                try:
                    for response in client.stream(chat(PROMPTS[outcome.prompt]), max_new_tokens=self.tokens):
                        if response.token_ids:
                            outcome.arrivals.append(time.monotonic())
                        outcome.tokens.extend(response.token_ids)
                except grpc.RpcError as error:
                    outcome.error = error.code().name
                outcome.ended = time.monotonic()
                with self._lock:
                    self.outcomes.append(outcome)

    def stop(self) -> list[Outcome]:
        """Send no more; wait for the requests in flight; every request's outcome."""
        self._stop.set()
        for thread in self._threads:
            thread.join()
        return self.outcomes


def references(address: str, tokens: int, prompts: int = len(PROMPTS)) -> list[list[int]]:
    """The plain greedy answer of each of the first `prompts` prompts, one at a time."""
    with SpecdecClient(address, timeout=900) as client:
        return [client.generate(chat(p), max_new_tokens=tokens, speculative=False).token_ids
                for p in PROMPTS[:prompts]]


def summary(outcomes: list[Outcome], expected: list[list[int]]) -> dict[str, object]:
    """What the clients lost, and whether every answer is plain decoding's (a prefix of it, to EOS)."""
    failed = [o for o in outcomes if o.error is not None]
    answered = [o for o in outcomes if o.error is None]
    exact = sum(o.tokens == expected[o.prompt][:len(o.tokens)] and len(o.tokens) > 0 for o in answered)
    return {"requests": len(outcomes), "completed": len(answered), "lost": len(failed),
            "lost_after_tokens": sum(bool(o.tokens) for o in failed),
            "errors": sorted({o.error for o in failed if o.error}), "greedy_exact": f"{exact}/{len(answered)}"}


def drain_phase(lb: str, gateway: ServiceProcess, streams: int, tokens: int, expected: list[list[int]],
                warm_s: float) -> dict[str, object]:
    """SIGTERM `gateway` `warm_s` into the load; the clients send until it has exited."""
    load = Load(lb, streams, tokens)
    time.sleep(warm_s)
    signalled = time.monotonic()
    gateway.process.send_signal(signal.SIGTERM)
    code = gateway.process.wait()
    exit_s = time.monotonic() - signalled
    outcomes = load.stop()
    during = [o for o in outcomes if o.ended >= signalled]
    return {**summary(outcomes, expected), "gateway_exit_s": round(exit_s, 1), "gateway_exit_code": code,
            "requests_ending_after_sigterm": len(during)}


def restart_phase(lb: str, stack: Stack, streams: int, tokens: int, expected: list[list[int]],
                  warm_s: float) -> dict[str, object]:
    """SIGKILL the target `warm_s` into the load and restart it on its port at once."""
    load = Load(lb, streams, tokens)
    time.sleep(warm_s)
    port = int(stack.target.address.rsplit(":", 1)[1])
    killed = time.monotonic()
    stack.target.process.kill()
    stack.target.process.wait()
    restarted = start_service("specdec.target_server", QUIET, port=port)
    try:
        restarted.wait_ready(900)
        serving = time.monotonic()
        time.sleep(warm_s)
        outcomes = load.stop()
    finally:
        restarted.stop()
    after = [t for o in outcomes for t in o.arrivals if t > serving]
    return {**summary(outcomes, expected), "target_down_s": round(serving - killed, 1),
            "first_token_after_serving_s": round(min(after) - serving, 1) if after else None}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16, help="clients sending at once")
    parser.add_argument("--tokens", type=int, default=200, help="new tokens per request")
    parser.add_argument("--warm-s", type=float, default=20.0, help="load before the SIGTERM or the kill")
    parser.add_argument("--phases", default="drain,restart", help="which phases run, comma-separated")
    args = parser.parse_args(argv)
    phases = set(args.phases.split(","))
    with running_stack(gateway_args=GATEWAY_ARGS) as stack, second_gateway(stack, GATEWAY_ARGS) as other:
        with running_haproxy([Backend.of(stack.gateway), Backend.of(other)]) as lb:
            expected = references(lb, args.tokens)
            if "drain" in phases:
                drain = drain_phase(lb, stack.gateway, args.streams, args.tokens, expected, args.warm_s)
                print(json.dumps({"phase": "drain", "cpu": cpu_model(), **vars(args), **drain}), flush=True)
            if "restart" in phases:
                restart = restart_phase(lb, stack, args.streams, args.tokens, expected, args.warm_s)
                print(json.dumps({"phase": "target_restart", "cpu": cpu_model(), **restart}), flush=True)


if __name__ == "__main__":
    main()
