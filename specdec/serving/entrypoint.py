"""`python -m specdec.target_server` / `python -m specdec.draft_server`: flags -> config -> server until a signal."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from specdec.errors import SpecdecError
from specdec.flags import add_flags, from_args
from specdec.serving.config import ModelServiceConfig
from specdec.serving.grpc_server import RunningServer, serve_until_signal
from specdec.serving.logs import LOG_LEVELS, configure_logging
from specdec.serving.ready import ReadyLine

C = TypeVar("C", bound=ModelServiceConfig)


def run_model_service(
    name: str,
    config_cls: type[C],
    create_server: Callable[[C], Awaitable[RunningServer]],
    argv: Sequence[str] | None = None,
) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m specdec.{name}", description=f"specdec {name}")
    add_flags(parser, config_cls)
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        config = from_args(config_cls, args)
    except SpecdecError as error:
        parser.error(str(error))

    async def serve() -> None:
        running = await create_server(config)
        print(ReadyLine(name, f"{config.host}:{running.port}", running.metrics_port), flush=True)
        await serve_until_signal(running)

    try:
        asyncio.run(serve())
    except (SpecdecError, OSError) as error:  # bad model path, port in use, ...: no traceback
        logging.getLogger(name).error("cannot start: %s", error)
        raise SystemExit(1) from None
