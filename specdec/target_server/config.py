"""Target service configuration: the big model. Its `auto` precision is fp32 on CPU, so greedy
output is exact, and bf16 on GPUs (`specdec.serving.config.MODEL_AUTO`)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.errors import InvalidArgumentError
from specdec.flags import inherit, option
from specdec.serving.config import ModelServiceConfig


@dataclass(frozen=True)
class TargetConfig(ModelServiceConfig):
    port: int = inherit(ModelServiceConfig, "port", 50052)
    compile: str = inherit(ModelServiceConfig, "compile", "auto")
    batch_invariant: bool = option(
        False, "run every verify and decode step in one fixed shape (--invariant-batch requests of "
        "max_speculative_tokens + 1 tokens, or more where this machine's matmuls need it, over max_seq_len keys), "
        "so a token's logits do not depend on its batch "
        "or chunk: speculative output then equals plain output bit for bit in bf16 too, at the cost of the padding "
        "(docs/architecture.md#exactness-in-bf16)", advanced=True,
    )
    invariant_batch: int = option(
        1, "requests per fixed-shape step with --batch-invariant (a larger batch runs as several steps)",
        advanced=True,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.invariant_batch <= 0:
            raise InvalidArgumentError(f"invariant_batch must be > 0, got {self.invariant_batch}",
                                       field="invariant_batch")
