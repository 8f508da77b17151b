"""`python -m specdec.gateway`: run the gateway alone, against model services started elsewhere.

This is how a multi-machine deployment runs it (one container per service); on one
machine `specdec serve` starts all three and calls `start_gateway` itself.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

import grpc
import torch

from specdec.errors import SpecdecError
from specdec.flags import add_flags, from_args
from specdec.gateway.config import GatewayConfig
from specdec.gateway.server import create_gateway
from specdec.serving.grpc_server import serve_until_signal
from specdec.serving.logs import LOG_LEVELS, configure_logging
from specdec.serving.ready import ReadyLine

log = logging.getLogger(__name__)


async def run_gateway(config: GatewayConfig) -> None:
    """Start the gateway, print its ready line and serve until SIGINT / SIGTERM."""
    running = await create_gateway(config)
    print(ReadyLine("gateway", f"{config.host}:{running.port}", running.metrics_port, running.http_port), flush=True)
    await serve_until_signal(running, grace=5.0)


def start_gateway(config: GatewayConfig) -> int:
    """Run the gateway to the end; a refused start-up prints one line and returns 1.

    Sets the process's torch threads (`GatewayConfig.threads`), so it is for a process of its
    own; an in-process gateway (tests) leaves its host's threads alone."""
    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        asyncio.run(run_gateway(config))
    except SpecdecError as error:  # e.g. tokenizer mismatch, K above the services' maximum
        print(f"error: gateway refused to start: {error}", file=sys.stderr)
        return 1
    except grpc.aio.AioRpcError as error:
        print(f"error: a model service did not answer: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.gateway", description="specdec gateway")
    add_flags(parser, GatewayConfig)
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        config = from_args(GatewayConfig, args)  # without a draft it speculates with lookups
    except SpecdecError as error:
        parser.error(str(error))
    return start_gateway(config)
