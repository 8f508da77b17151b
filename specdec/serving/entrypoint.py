"""`python -m target_server` / `python -m draft_server`: flags -> config -> server until a signal."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from specdec.errors import SpecdecError
from specdec.serving.config import C, add_config_flags, config_from_args
from specdec.serving.grpc_server import RunningServer, serve_until_signal

#: Printed once the port is bound; launchers (tests, `specdec serve`) wait for this line.
READY_MESSAGE = "{name} listening on {host}:{port}"


def run_model_service(
    name: str,
    config_cls: type[C],
    create_server: Callable[[C], Awaitable[RunningServer]],
    argv: Sequence[str] | None = None,
) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {name}", description=f"specdec {name}")
    add_config_flags(parser, config_cls())
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(config_cls, args)
    except SpecdecError as error:
        parser.error(str(error))

    async def serve() -> None:
        running = await create_server(config)
        print(READY_MESSAGE.format(name=name, host=config.host, port=running.port), flush=True)
        await serve_until_signal(running)

    try:
        asyncio.run(serve())
    except (SpecdecError, OSError) as error:  # bad model path, port in use, ...: no traceback
        logging.getLogger(name).error("cannot start: %s", error)
        raise SystemExit(1) from None
