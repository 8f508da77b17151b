"""`make demo`: start draft, target and gateway, stream one generation, shut everything down."""

from __future__ import annotations

import sys

from specdec.cli.launcher import start_service
from specdec.cli.main import main as specdec_cli

PROMPT = "Write a short poem about the ocean at night."


def main() -> int:
    print("starting target (fp32), draft (int4) and gateway (`specdec serve`) ...", flush=True)
    serve = start_service("specdec.cli", ["serve"], ready_name="gateway")
    try:
        try:
            gateway = serve.wait_ready()
        except (RuntimeError, TimeoutError) as error:
            print(f"specdec serve did not become ready: {error}", file=sys.stderr)
            return 1
        print(f"gateway on {gateway.address}\n\n> {PROMPT}\n", flush=True)
        # Exactly what a user runs against the gateway: `specdec generate`.
        return specdec_cli(["generate", PROMPT, "--gateway", gateway.address, "--max-new-tokens", "96"])
    finally:
        serve.stop(grace=60.0)


if __name__ == "__main__":
    sys.exit(main())
