"""Start the model services as child processes and wait until they listen.

`specdec serve` and the end-to-end tests use this: each service runs as
`python -m <module> --port 0 ...`, prints one ready line with its bound address on
stdout, and is stopped with SIGTERM (graceful) then SIGKILL after a grace period.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

_READY = re.compile(r"listening on (\S+:\d+)")


@dataclass
class ServiceProcess:
    name: str
    process: subprocess.Popen[str]
    address: str

    def stop(self, grace: float = 10.0) -> int:
        """SIGTERM, wait up to `grace` seconds, then SIGKILL. Returns the exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return int(self.process.returncode)


def spawn_service(module: str, args: Sequence[str] = (), *, timeout: float = 300.0) -> ServiceProcess:
    """Run `python -m module --port 0 *args` and return once it prints its ready line."""
    process = subprocess.Popen(
        [sys.executable, "-m", module, "--port", "0", *args],
        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, bufsize=1,
    )
    found: list[str] = []
    ready = threading.Event()

    def read_stdout() -> None:  # keeps draining so the child never blocks on a full pipe
        assert process.stdout is not None
        for line in process.stdout:
            if not found and (match := _READY.search(line)):
                found.append(match.group(1))
                ready.set()
            elif found:
                sys.stdout.write(line)
        ready.set()

    threading.Thread(target=read_stdout, name=f"{module}-stdout", daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.1):
        if time.monotonic() > deadline:
            process.kill()
            raise TimeoutError(f"{module} did not start within {timeout:.0f} s")
    if not found:
        code = process.wait()
        raise RuntimeError(f"{module} exited with code {code} before listening (see its log above)")
    return ServiceProcess(module, process, found[0])
