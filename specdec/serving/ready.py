"""The one line a service prints on stdout once its port is bound, and its one parser.

    <name> listening on <host>:<port>[, metrics on :<port>][, http on :<port>]

Launchers (`specdec serve`, the demo, the benchmarks, the tests) start a service with
`--port 0` and read the bound address from this line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_PATTERN = re.compile(
    r"^(?P<name>\S+) listening on (?P<address>\S+:\d+)(?:, metrics on :(?P<metrics>\d+))?(?:, http on :(?P<http>\d+))?$"
)


@dataclass(frozen=True)
class ReadyLine:
    name: str
    address: str  # host:port
    metrics_port: int | None = None
    #: The gateway's OpenAI-compatible HTTP port, when it serves one.
    http_port: int | None = None

    def __str__(self) -> str:
        metrics = f", metrics on :{self.metrics_port}" if self.metrics_port is not None else ""
        http = f", http on :{self.http_port}" if self.http_port is not None else ""
        return f"{self.name} listening on {self.address}{metrics}{http}"


def parse_ready_line(line: str) -> ReadyLine | None:
    """The ready line's fields, or None for any other line of output."""
    match = _PATTERN.match(line.strip())
    if match is None:
        return None
    metrics, http = match.group("metrics"), match.group("http")
    return ReadyLine(match.group("name"), match.group("address"), int(metrics) if metrics else None,
                     int(http) if http else None)
