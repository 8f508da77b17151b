"""Draft service configuration: the embedded default is the int8 self-draft with bf16 activations."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.serving.config import ModelServiceConfig


@dataclass(frozen=True)
class DraftConfig(ModelServiceConfig):
    dtype: str = "bfloat16"
    quantization: str = "int8"
    port: int = 50051
