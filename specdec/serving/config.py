"""Configuration shared by the two model services, and its command-line flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from specdec.errors import InvalidArgumentError
from specdec.model.loader import DEFAULT_MODEL
from specdec.model.runtime import DTYPES, QUANTIZATIONS
from specdec.serving.grpc_server import DEFAULT_MAX_MESSAGE_BYTES

C = TypeVar("C", bound="ModelServiceConfig")


@dataclass(frozen=True)
class ModelServiceConfig:
    """What a model service (draft or target) loads, how big its pools are, where it listens."""

    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    device: str = "cpu"
    quantization: str = "none"
    #: Weights per scale/zero group of int4 quantization.
    group_size: int = 32
    #: Keep only the first N decoder layers (0 = all): a weak draft for testing rejections.
    num_layers: int = 0
    host: str = "127.0.0.1"
    port: int = 0
    #: Concurrent slots (requests) the service holds.
    max_slots: int = 64
    #: KV-cache capacity in tokens, summed over all slots.
    kv_token_budget: int = 16384
    block_size: int = 16
    #: Largest K (draft tokens per request and round) accepted.
    max_spec_tokens: int = 16
    #: Longest sequence a slot may hold; 0 means the model's own limit.
    max_seq_len: int = 0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    #: Time the forward pass over a small grid at start-up and advertise it in Info.
    measure_costs: bool = True
    #: Intra-op threads of the forward pass; 0 keeps torch's default (one per core).
    threads: int = 0
    #: Pin the process to these CPU cores ("0", "0,1", "0-3"); empty leaves it unpinned.
    cpu_cores: str = ""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidArgumentError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise InvalidArgumentError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if not 0 <= self.port <= 65535:
            raise InvalidArgumentError(f"port must be in 0..65535, got {self.port}")
        for name in ("group_size", "max_slots", "kv_token_budget", "block_size", "max_spec_tokens", "max_message_bytes"):
            if getattr(self, name) <= 0:
                raise InvalidArgumentError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_layers < 0:
            raise InvalidArgumentError(f"num_layers must be >= 0, got {self.num_layers}")
        if self.threads < 0:
            raise InvalidArgumentError(f"threads must be >= 0, got {self.threads}")
        parse_cores(self.cpu_cores)
        if self.max_seq_len < 0:
            raise InvalidArgumentError(f"max_seq_len must be >= 0, got {self.max_seq_len}")


def parse_cores(spec: str) -> set[int]:
    """CPU core numbers from "0,2" or "0-3" (empty: none); InvalidArgumentError when malformed."""
    cores: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise InvalidArgumentError(f"cpu_cores: {part!r} is not a core number or range") from None
        if not 0 <= first <= last:
            raise InvalidArgumentError(f"cpu_cores: {part!r} is not a valid range")
        cores.update(range(first, last + 1))
    return cores


_HELP = {
    "model": "embedded name (smollm2-135m), .gguf file, local directory or hub id",
    "dtype": "compute dtype of the forward pass",
    "device": "torch device, e.g. cpu or cuda:0",
    "quantization": "weight-only quantization: int8 per channel, or int4 in groups (from a GGUF's own Q4 blocks when it has them)",
    "group_size": "weights per scale group of int4 quantization",
    "num_layers": "keep only the first N decoder layers (0 = all; a weak draft for tests)",
    "host": "address to bind",
    "port": "port to bind (0 = any free port, printed at start)",
    "max_slots": "concurrent request slots",
    "kv_token_budget": "KV-cache capacity in tokens over all slots",
    "block_size": "tokens per KV-cache block",
    "max_spec_tokens": "largest K per request and round",
    "max_seq_len": "longest sequence per slot (0 = the model's limit)",
    "max_message_bytes": "largest gRPC message sent or received",
    "measure_costs": "time the forward pass at start-up so the gateway can plan K from real costs",
    "threads": "intra-op threads of the forward pass (0 = one per core)",
    "cpu_cores": "pin the service to these CPU cores, e.g. 0 or 0-1 (empty = no pinning)",
}
_CHOICES: dict[str, Any] = {"dtype": sorted(DTYPES), "quantization": list(QUANTIZATIONS)}
_ALIASES: dict[str, list[str]] = {"quantization": ["--quantize"]}


def add_config_flags(parser: argparse.ArgumentParser, defaults: ModelServiceConfig) -> None:
    """One `--flag` per config field, defaulting to `defaults`' values."""
    for field in fields(defaults):
        default = getattr(defaults, field.name)
        if isinstance(default, bool):
            parser.add_argument(
                f"--{field.name.replace('_', '-')}", dest=field.name, action=argparse.BooleanOptionalAction,
                default=default, help=f"{_HELP[field.name]} (default: {default})",
            )
            continue
        parser.add_argument(
            f"--{field.name.replace('_', '-')}", *_ALIASES.get(field.name, []), dest=field.name, type=type(default), default=default,
            choices=_CHOICES.get(field.name), help=f"{_HELP[field.name]} (default: {default})",
        )


def config_from_args(cls: type[C], args: argparse.Namespace) -> C:
    return cls(**{field.name: getattr(args, field.name) for field in fields(cls)})
