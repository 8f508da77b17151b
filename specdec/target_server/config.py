"""Target service configuration: the big model, fp32 by default so greedy output is exact."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.flags import inherit
from specdec.serving.config import ModelServiceConfig


@dataclass(frozen=True)
class TargetConfig(ModelServiceConfig):
    port: int = inherit(ModelServiceConfig, "port", 50052)
