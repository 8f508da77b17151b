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

from specdec.errors import InvalidArgumentError
from specdec.flags import inherit, option
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
    #: Gateways in step reach the draft within milliseconds of each other, after one merged
    #: Verify. One out of step is at the target, held there for the other's Verify: held here
    #: for long too, each service would wait for the other's held call.
    merge_wait_s: float = inherit(ModelServiceConfig, "merge_wait_s", 0.02)
    lookup_guess_tokens: int = option(
        8, "most tokens one drafting step feeds as guesses from the draft's own lookup or a grammar's forced "
        "tokens, shared by the step's requests (a guess widens every row of the batched forward); 0 turns the "
        "draft's own lookups off, and forced tokens after its first forward",
        advanced=True,
    )
    lookup_guess_min_match: int = option(
        2, "shortest real match (tokens before the guess that equal the text's last ones) the draft guesses from",
        advanced=True,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lookup_guess_tokens < 0 or self.lookup_guess_min_match < 1:
            raise InvalidArgumentError(f"lookup_guess_tokens must be >= 0 and lookup_guess_min_match >= 1, got "
                                       f"{self.lookup_guess_tokens} and {self.lookup_guess_min_match}",
                                       field="lookup_guess_tokens")
