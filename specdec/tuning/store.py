"""Start-up measurements kept on disk, keyed by everything they depend on.

A restart on the same machine, with the same torch, model, weights, dtype, quantization,
device, thread count, code and service settings, reuses what the last start measured; a
change in any of them measures again. One JSON file per key under
`<specdec cache dir>/tuning/`, written atomically; an unreadable or foreign file is ignored
with a warning (and replaced after the next measurement).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

#: Bumped when the file layout changes.
FORMAT = 1
#: Source trees whose code defines what was measured (kernels, forward, cache layout, the
#: measurements themselves): any edit there measures again.
CODE_DIRS = ("model", "kv_cache", "tuning")


@dataclass(frozen=True)
class TuningKey:
    """What a service's start-up measurements depend on."""

    machine: str  # CPU model and flags, or the GPU's name
    torch: str
    model: str  # the model id the service was given
    weights: str  # fingerprint of the weight files (`specdec.model.loader.weights_fingerprint`)
    dtype: str
    quantization: str
    device: str
    threads: int
    code: str  # `code_version()`
    settings: str  # the service flags that shape the measurements (pool, grid limits, layers, ...)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def machine_fingerprint(device: torch.device | str) -> str:
    """The GPU's name on CUDA; elsewhere the CPU's model name and a hash of its feature flags."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    model = fields.get("model name") or platform.processor() or platform.machine()
    flags = fields.get("flags", "")
    return f"{model} [{hashlib.sha256(flags.encode()).hexdigest()[:12]}]"


def code_version(root: Path | None = None) -> str:
    """A hash of the Python and C++ sources under `CODE_DIRS` of the `specdec` package."""
    root = root or Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for directory in CODE_DIRS:
        for path in sorted((root / directory).rglob("*")):
            if path.suffix in (".py", ".cpp", ".h") and path.is_file():
                digest.update(str(path.relative_to(root)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class TuningStore:
    """JSON files of measured choices under `root`, one per `TuningKey`."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, key: TuningKey) -> Path:
        return self.root / f"{key.digest()}.json"

    def load(self, key: TuningKey) -> dict[str, Any]:
        """The choices stored for `key`; {} when there are none or the file cannot be used."""
        path = self.path(key)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as error:
            log.warning("tuning cache %s unreadable, measuring again: %s", path, error)
            return {}
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != dataclasses.asdict(key):
                raise ValueError("written for another key or format")
            choices = data["choices"]
            if not isinstance(choices, dict):
                raise ValueError("no choices")
        except (ValueError, KeyError) as error:
            log.warning("tuning cache %s ignored, measuring again: %s", path, error)
            return {}
        return choices

    def save(self, key: TuningKey, choices: dict[str, Any]) -> None:
        """Write `choices` for `key` (atomically: a reader never sees half a file); a failure
        to write only costs the next start a measurement."""
        data = {"format": FORMAT, "key": dataclasses.asdict(key), "choices": choices}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, partial = tempfile.mkstemp(prefix=".tuning-", dir=self.root)
            with os.fdopen(fd, "w") as file:
                json.dump(data, file, indent=1, sort_keys=True)
            os.replace(partial, self.path(key))
        except OSError as error:
            log.warning("tuning cache %s not written: %s", self.path(key), error)
