"""`python -m gateway`: run the gateway alone, against model services started elsewhere.

This is how a multi-machine deployment runs it (one container per service); on one
machine `specdec serve` starts all three.
"""

from __future__ import annotations

import argparse
import logging
import sys

from gateway.cli import start_gateway
from gateway.config import GatewayConfig
from specdec.errors import SpecdecError


def main() -> int:
    defaults = GatewayConfig(target_address="-", speculative=False)
    parser = argparse.ArgumentParser(prog="python -m gateway", description="specdec gateway")
    parser.add_argument("--target", required=True, help="target service address, host:port")
    parser.add_argument("--draft", default="", help="draft service address; omit to run without speculation")
    parser.add_argument("--host", default=defaults.host)
    parser.add_argument("--port", type=int, default=defaults.port)
    parser.add_argument("--metrics-port", type=int, default=defaults.metrics_port, help="-1 = off, 0 = any free port")
    parser.add_argument("--spec-length", type=int, default=defaults.spec_length)
    parser.add_argument("--adaptive-k", action=argparse.BooleanOptionalAction, default=defaults.adaptive_k,
                        help="choose K in 0..--spec-length each round from measured costs and acceptance")
    parser.add_argument("--no-speculative", action="store_true", help="plain decoding unless a request asks otherwise")
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens_default)
    parser.add_argument("--max-batch-size", type=int, default=defaults.max_batch_size)
    parser.add_argument("--max-queue", type=int, default=defaults.max_queue)
    parser.add_argument("--draft-probs-dtype", default=defaults.draft_probs_dtype, choices=["float32", "bfloat16"])
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = GatewayConfig(
            target_address=args.target, draft_address=args.draft, host=args.host, port=args.port,
            speculative=bool(args.draft) and not args.no_speculative, spec_length=args.spec_length,
            adaptive_k=args.adaptive_k,
            max_new_tokens_default=args.max_new_tokens, max_batch_size=args.max_batch_size,
            max_queue=args.max_queue, draft_probs_dtype=args.draft_probs_dtype, metrics_port=args.metrics_port,
        )
    except SpecdecError as error:
        parser.error(str(error))
    return start_gateway(config)


if __name__ == "__main__":
    sys.exit(main())
