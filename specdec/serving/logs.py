"""Log set-up shared by every entry point: the services, the gateway and the command line.

Imports nothing but `logging`, so the light commands (`specdec generate`) can use it without
loading torch.
"""

from __future__ import annotations

import logging

LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
