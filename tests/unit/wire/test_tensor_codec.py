"""Round-trip tests of the raw-bytes tensor codec."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import InvalidArgumentError
from specdec.v1 import common_pb2
from specdec.wire.tensor_codec import decode_tensor, encode_tensor

LLAMA3_VOCAB = 128_256


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern, so -0.0, infinities and NaN payloads compare exactly."""
    return tensor.reshape(-1).view(torch.int32 if tensor.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 4)])
def test_round_trip_is_bit_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    decoded = decode_tensor(encode_tensor(tensor))
    assert decoded.dtype == dtype
    assert decoded.shape == tensor.shape
    assert torch.equal(_bits(decoded), _bits(tensor))


def test_full_llama3_vocab_row_bf16_and_fp32() -> None:
    logits = torch.randn(LLAMA3_VOCAB, generator=torch.Generator().manual_seed(1))  # [vocab]
    message = encode_tensor(logits)
    assert len(message.data) == LLAMA3_VOCAB * 4
    assert torch.equal(decode_tensor(message), logits)
    compressed = encode_tensor(logits, dtype=torch.bfloat16)
    assert len(compressed.data) == LLAMA3_VOCAB * 2
    assert torch.equal(decode_tensor(compressed), logits.to(torch.bfloat16))


def test_special_values_survive() -> None:
    values = torch.tensor([float("inf"), float("-inf"), -0.0, 1e-45, 3.4e38])
    for dtype in (torch.float32, torch.bfloat16):
        sent = values.to(dtype)
        got = decode_tensor(encode_tensor(sent))
        assert torch.equal(_bits(got), _bits(sent))
    nan = decode_tensor(encode_tensor(torch.tensor([float("nan")])))
    assert torch.isnan(nan).all()


def test_serialised_message_round_trip() -> None:
    tensor = torch.randn(4, 9)
    wire_bytes = encode_tensor(tensor).SerializeToString()
    assert torch.equal(decode_tensor(common_pb2.Tensor.FromString(wire_bytes)), tensor)


def test_decoded_tensor_is_writable_and_independent() -> None:
    message = encode_tensor(torch.zeros(3))
    decoded = decode_tensor(message)
    decoded += 1
    assert torch.equal(decode_tensor(message), torch.zeros(3))


def test_size_mismatch_is_rejected() -> None:
    message = encode_tensor(torch.zeros(4))
    message.shape[:] = [5]
    with pytest.raises(InvalidArgumentError, match="needs 20"):
        decode_tensor(message)


def test_unknown_dtype_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError):
        decode_tensor(common_pb2.Tensor(dtype=common_pb2.DTYPE_UNSPECIFIED, shape=[1], data=b"\0\0\0\0"))
    with pytest.raises(InvalidArgumentError):
        encode_tensor(torch.zeros(2, dtype=torch.int64))
