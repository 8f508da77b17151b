"""What a service chose at start-up and why: one record per choice, one log line for all."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Why a choice was made: timed now, reused from the tuning cache, set by a flag (or the
#: environment), or fixed by the machine, the model or another choice.
REASONS = ("measured", "cached", "flag", "fixed")


@dataclass(frozen=True)
class TuningChoice:
    """One start-up choice, e.g. ("int4_kernel", "int4dot", "measured", "int4dot 0.53 ms, ...")."""

    name: str
    value: str
    reason: str  # one of REASONS
    #: What the choice rests on, for people: the timings that decided it, a path, ...
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.name}={self.value} ({self.reason}{': ' + self.detail if self.detail else ''})"


def tuning_line(choices: Sequence[TuningChoice]) -> str:
    """The one log line listing every choice, in the order made."""
    return "start-up choices: " + "; ".join(str(choice) for choice in choices)
