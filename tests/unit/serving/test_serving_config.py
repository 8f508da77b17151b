"""Entry-point flags, config validation and the one error-mapping layer (no model needed)."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from specdec.draft_server.config import DraftConfig
from specdec.errors import CapacityExhaustedError, InvalidArgumentError, SlotExistsError, SlotNotFoundError
from specdec.flags import parse_config
from specdec.serving.config import AUTO, Precision
from specdec.serving.errors import status_of
from specdec.target_server.config import TargetConfig
from specdec.wire.limits import DEFAULT_MAX_MESSAGE_BYTES


def parse(config_cls: type[TargetConfig] | type[DraftConfig], *argv: str) -> TargetConfig | DraftConfig:
    return parse_config(config_cls, argv)


def test_defaults() -> None:
    target, draft = parse(TargetConfig), parse(DraftConfig)
    assert target.host == draft.host == "127.0.0.1"
    assert (target.dtype, target.quantization) == (draft.dtype, draft.quantization) == ("auto", "auto")
    assert target.precision() == Precision("float32", "none")  # exact greedy output on the CPU
    assert draft.precision() == Precision("bfloat16", "int4")  # the quantized self-draft
    assert target.port != draft.port
    assert target.max_message_bytes == DEFAULT_MAX_MESSAGE_BYTES > 4 * 1024 * 1024  # above gRPC's 4 MB default


def test_every_flag_reaches_the_config() -> None:
    config = parse(
        TargetConfig, "--model", "m.gguf", "--dtype", "bfloat16", "--device", "cpu", "--quantization", "int8",
        "--host", "0.0.0.0", "--port", "0", "--max-slots", "3", "--kv-token-budget", "100", "--block-size", "8",
        "--max-speculative-tokens", "5", "--max-seq-len", "64", "--max-message-bytes", "1000", "--num-layers", "2",
    )
    assert config == TargetConfig(
        model="m.gguf", dtype="bfloat16", device="cpu", quantization="int8", host="0.0.0.0", port=0, max_slots=3,
        kv_token_budget=100, block_size=8, max_speculative_tokens=5, max_seq_len=64, max_message_bytes=1000,
        num_layers=2,
    )


@pytest.mark.parametrize("gpu", ["cuda", "cuda:1"])
def test_auto_precision_on_a_gpu_is_unquantized_bf16(gpu: str) -> None:
    # int4 off the CPU is a dequantized copy plus an int8 head dequantized at every call.
    assert parse(TargetConfig, "--device", gpu).precision() == Precision("bfloat16", "none")
    assert parse(DraftConfig, "--device", gpu).precision() == Precision("bfloat16", "none")


def test_flags_override_auto_one_at_a_time() -> None:
    draft = parse(DraftConfig, "--device", "cuda", "--quantization", "int4")
    assert draft.precision() == Precision("bfloat16", "int4")
    target = parse(TargetConfig, "--device", "cuda", "--dtype", "float32")
    assert target.precision() == Precision("float32", "none")
    assert parse(DraftConfig, "--dtype", "float32").precision() == Precision("float32", "int4")
    # Changing the device of a config changes what its auto fields become, not what was set.
    moved = dataclasses.replace(parse(TargetConfig), device="cuda")
    assert (moved.dtype, moved.precision().dtype) == (AUTO, "bfloat16")


def test_help_says_what_auto_picks() -> None:
    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(DraftConfig)}
    assert helps["quantization"].endswith("auto: int4 on CPU, none on GPUs")
    assert helps["dtype"].endswith("auto: bfloat16")
    target_dtype = next(f for f in dataclasses.fields(TargetConfig) if f.name == "dtype")
    assert target_dtype.metadata["help"].endswith("auto: float32 on CPU, bfloat16 on GPUs")


def test_compile_budget_reaches_the_config() -> None:
    assert parse(DraftConfig).compile_budget_s == 25.0
    assert parse(DraftConfig, "--compile-budget-s", "300").compile_budget_s == 300.0


def test_attention_and_prefill_chunks_reach_the_config() -> None:
    config = parse(TargetConfig)
    assert (config.attention, config.prefill_chunk_tokens) == ("auto", 2048)
    config = parse(DraftConfig, "--attention", "gather", "--prefill-chunk-tokens", "64")
    assert (config.attention, config.prefill_chunk_tokens) == ("gather", 64)


def test_quantize_is_an_alias_of_quantization() -> None:
    assert parse(DraftConfig, "--quantize", "none").quantization == "none"
    assert parse(TargetConfig, "--quantize", "int8").quantization == "int8"


@pytest.mark.parametrize(
    "fields",
    [
        dict(dtype="float64"), dict(quantization="int2"), dict(port=70000), dict(port=-1), dict(max_slots=0),
        dict(kv_token_budget=0), dict(block_size=0), dict(max_speculative_tokens=0), dict(max_message_bytes=0),
        dict(max_seq_len=-1), dict(group_size=0), dict(threads=-1), dict(cpu_cores="0-x"), dict(cpu_cores="3-1"),
        dict(compile_budget_s=-1.0), dict(compile_budget_s=float("nan")), dict(device="gpu0"),
        dict(attention="flash"),
        dict(prefill_chunk_tokens=0), dict(merge_wait_s=-0.1), dict(merge_wait_s=float("nan")),
        dict(merge_wait_s=float("inf")),
    ],
)
def test_bad_config_raises_a_typed_error(fields: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError, match=next(iter(fields))):
        TargetConfig(**fields)  # type: ignore[arg-type]


def test_bad_flag_choice_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        parse(DraftConfig, "--quantization", "int2")


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidArgumentError("k: too big"), grpc.StatusCode.INVALID_ARGUMENT),
        (SlotNotFoundError("slot 'x' not found"), grpc.StatusCode.NOT_FOUND),
        (SlotExistsError("slot_id: slot 'x' already exists"), grpc.StatusCode.ALREADY_EXISTS),
        (CapacityExhaustedError("no blocks", resource="kv_blocks"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    ],
)
def test_engine_errors_map_to_their_status_with_their_message(error: Exception, code: grpc.StatusCode) -> None:
    assert status_of(error) == (code, str(error))
    assert "'x' not found" == str(SlotNotFoundError("'x' not found"))  # no KeyError quoting


def test_bugs_map_to_internal_without_leaking_the_message() -> None:
    code, message = status_of(RuntimeError("secret detail"))
    assert code == grpc.StatusCode.INTERNAL
    assert "secret" not in message and "RuntimeError" in message
