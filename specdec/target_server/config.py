"""Target service configuration: the big model. Its `auto` precision is fp32 on CPU, so greedy
output is exact, and bf16 on GPUs (`specdec.serving.config.MODEL_AUTO`)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.flags import inherit
from specdec.serving.config import ModelServiceConfig


@dataclass(frozen=True)
class TargetConfig(ModelServiceConfig):
    port: int = inherit(ModelServiceConfig, "port", 50052)
