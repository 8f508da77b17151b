"""`make demo`: start draft, target and gateway, stream one generation, shut everything down."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys

from specdec.client import GenerationResult, SpecdecClient, apply_completion

PROMPT = "Write a short poem about the ocean at night."


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> int:
    port = _free_port()
    print(f"starting draft (int8), target (fp32) and gateway on 127.0.0.1:{port} ...", flush=True)
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
        result = GenerationResult()
        with SpecdecClient(f"127.0.0.1:{port}") as client:
            for response in client.stream([{"role": "user", "content": PROMPT}], max_new_tokens=96):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                result.token_ids.extend(response.token_ids)
                if response.HasField("completion"):
                    apply_completion(result, response.completion)
        print(
            f"\n\n[{result.completion_tokens} tokens, finish: {result.finish_reason}, "
            f"acceptance rate {result.acceptance_rate:.2f}, mean acceptance length "
            f"{result.mean_acceptance_length:.2f}, {result.tokens_per_s:.1f} tok/s]"
        )
        return 0
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(60)


if __name__ == "__main__":
    sys.exit(main())
