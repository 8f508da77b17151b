"""Draft service configuration.

On CPU the default draft is the target checkpoint quantized to int4 in groups of 32 (from the
GGUF's own Q4 blocks for the embedded model), with bf16 activations: measured side by side
against the int8 draft it was as fast end to end or faster, with higher acceptance
(docs/performance.md). On GPUs it is unquantized bf16: the int4 kernels are the CPU's, and
elsewhere int4 is a dequantized bf16 copy plus an int8 output head dequantized at every call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specdec.flags import inherit
from specdec.serving.config import DTYPE_HELP, QUANTIZATION_HELP, AutoPrecision, ModelServiceConfig, Precision

DRAFT_AUTO = AutoPrecision(cpu=Precision("bfloat16", "int4"), accelerator=Precision("bfloat16", "none"))


@dataclass(frozen=True)
class DraftConfig(ModelServiceConfig):
    AUTO_PRECISION: ClassVar[AutoPrecision] = DRAFT_AUTO

    dtype: str = inherit(ModelServiceConfig, "dtype", help=DRAFT_AUTO.help(DTYPE_HELP, "dtype"))
    quantization: str = inherit(
        ModelServiceConfig, "quantization", help=DRAFT_AUTO.help(QUANTIZATION_HELP, "quantization"),
    )
    compile: str = inherit(ModelServiceConfig, "compile", "auto")
    port: int = inherit(ModelServiceConfig, "port", 50051)
