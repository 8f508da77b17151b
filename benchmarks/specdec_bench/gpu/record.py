"""What a stage of the check found, written down as it goes."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from enum import Enum
from pathlib import Path
from typing import Any


class StageFailure(RuntimeError):
    """A stage ran to its end and found the product wrong (not a crash of the check itself)."""


def plain(value: Any) -> Any:
    """`value` as strict JSON: dataclasses and enums unpacked, NaN and infinities as null."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclasses.asdict(value))
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class Record:
    """A stage's figures by name, rewritten to `path` after every one, so a stage killed at
    its time box keeps what it measured before."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.figures: dict[str, Any] = {}

    def put(self, name: str, value: Any) -> None:
        self.figures[name] = plain(value)
        staging = self.path.with_name(self.path.name + ".tmp")
        staging.write_text(json.dumps(self.figures, indent=1, allow_nan=False))
        os.replace(staging, self.path)  # whole or not at all, should the stage be killed now

    @staticmethod
    def read(path: Path) -> dict[str, Any]:
        """What a stage wrote ({} if it wrote nothing)."""
        try:
            figures = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return figures if isinstance(figures, dict) else {}
