"""Start the model services as child processes and wait until they listen.

`specdec serve`, the demo and the benchmarks use this: each service runs as
`python -m <module> --port 0 ...`, prints its ready line (`specdec.serving.ready`) on
stdout, and is stopped with SIGTERM (graceful) then SIGKILL after a grace period.
Start several with `start_service` first and `wait_ready` after, so they load in parallel.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from specdec.serving.ready import ReadyLine, parse_ready_line


class ServiceProcess:
    """A model service child process and, once ready, the address it listens on."""

    def __init__(self, module: str, args: Sequence[str], ready_name: str = "", port: int = 0) -> None:
        self.name = module
        #: Wait for the ready line of this name (default: the first ready line printed).
        self.ready_name = ready_name
        #: The service's ready line once it printed it: bound address (and metrics port).
        self.ready: ReadyLine | None = None
        #: Seconds from the start of the process to its ready line (None until then).
        self.ready_s: float | None = None
        self._ready = threading.Event()
        self._started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, *args, "--port", str(port)],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, bufsize=1,
        )
        self._reader = threading.Thread(target=self._read_stdout, name=f"{module}-stdout", daemon=True)
        self._reader.start()

    def _read_stdout(self) -> None:
        """Find the ready line, then keep draining so the child never blocks on a full pipe."""
        assert self.process.stdout is not None
        for line in self.process.stdout:
            ready = parse_ready_line(line) if self.ready is None else None
            if ready is not None and self.ready_name in ("", ready.name):
                self.ready = ready
                self.ready_s = time.monotonic() - self._started
                self._ready.set()
            elif self.ready is not None:
                sys.stdout.write(line)
        self._ready.set()  # EOF: the child exited

    @property
    def address(self) -> str:
        """host:port the service listens on ("" until it is ready)."""
        return self.ready.address if self.ready is not None else ""

    def wait_ready(self, timeout: float = 300.0) -> ServiceProcess:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.1):
            if time.monotonic() > deadline:
                self.stop(grace=1.0)
                raise TimeoutError(f"{self.name} did not start within {timeout:.0f} s")
        if self.ready is None:
            code = self.process.wait()
            raise RuntimeError(f"{self.name} exited with code {code} before listening (see its log above)")
        return self

    def stop(self, grace: float = 10.0) -> int:
        """SIGTERM, wait up to `grace` seconds, then SIGKILL. Returns the exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(timeout=5.0)  # its last lines are written before stop() returns
        return int(self.process.returncode)


def start_service(module: str, args: Sequence[str] = (), ready_name: str = "", port: int = 0) -> ServiceProcess:
    """Launch `python -m module *args --port <port>` without waiting for it (`wait_ready` waits).
    Port 0 (the default) binds a free port; a given port restarts a service where it was."""
    return ServiceProcess(module, args, ready_name, port)

