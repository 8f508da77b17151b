"""The command line: `specdec serve | generate | info | health`, the process launcher and `make demo`.

The top layer: it may import the services and the shared library, and nothing imports it
(except the benchmark harness, which drives the same launcher and adds `specdec bench`
through an entry point, `main.COMMAND_GROUP`). `main` dispatches
`specdec health`, `specdec generate` and `specdec info` before anything heavy is imported:
health checks run the first every few seconds, and the others are clients, which need
neither torch nor a model.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["health"]:
        from specdec.cli.health import main as health_main

        return health_main(args[1:])
    if args[:1] == ["generate"]:
        from specdec.cli.generate import main as generate_main

        return generate_main(args[1:])
    if args[:1] == ["info"]:
        from specdec.cli.info import main as info_main

        return info_main(args[1:])
    from specdec.cli.main import main as full_main

    return full_main(args)
