"""Draft service configuration.

The default draft is the target checkpoint quantized to int4 in groups of 32 (from the
GGUF's own Q4 blocks for the embedded model), with bf16 activations: measured side by side
against the int8 draft it was as fast end to end or faster, with higher acceptance
(docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.flags import inherit
from specdec.serving.config import ModelServiceConfig


@dataclass(frozen=True)
class DraftConfig(ModelServiceConfig):
    dtype: str = inherit(ModelServiceConfig, "dtype", "bfloat16")
    quantization: str = inherit(ModelServiceConfig, "quantization", "int4")
    compile: str = inherit(ModelServiceConfig, "compile", "auto")
    port: int = inherit(ModelServiceConfig, "port", 50051)
