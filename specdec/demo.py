"""`make demo`: start draft, target and gateway, stream one generation, shut everything down."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys

from gateway.cli import main as generate_cli

PROMPT = "Write a short poem about the ocean at night."


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> int:
    port = _free_port()
    print(f"starting draft (int4), target (fp32) and gateway on 127.0.0.1:{port} ...", flush=True)
    serve = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert serve.stdout is not None
        for line in serve.stdout:
            if re.search(r"gateway listening on", line):
                break
        else:
            print("specdec serve exited before the gateway was ready", file=sys.stderr)
            return 1
        print(f"\n> {PROMPT}\n", flush=True)
        # Exactly what a user runs against the gateway: `specdec generate`.
        return generate_cli(["generate", PROMPT, "--gateway", f"127.0.0.1:{port}", "--max-new-tokens", "96"])
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(60)


if __name__ == "__main__":
    sys.exit(main())
