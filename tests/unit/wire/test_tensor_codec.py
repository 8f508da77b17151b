"""Round-trip tests of the raw-bytes tensor codec, from and to tensors on `--device`."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import InvalidArgumentError
from specdec.v1 import common_pb2
from specdec.wire.tensor_codec import decode_tensor, encode_tensor

pytestmark = pytest.mark.device_agnostic
LLAMA3_VOCAB = 128_256


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern, so -0.0, infinities and NaN payloads compare exactly."""
    return tensor.reshape(-1).view(torch.int32 if tensor.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 4)])
def test_round_trip_is_bit_exact(dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> None:
    tensor = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 100).to(device, dtype)
    decoded = decode_tensor(encode_tensor(tensor), device)
    assert decoded.dtype == dtype and decoded.device == device
    assert decoded.shape == tensor.shape
    assert torch.equal(_bits(decoded), _bits(tensor))


def test_full_llama3_vocab_row_bf16_and_fp32(device: torch.device) -> None:
    logits = torch.randn(LLAMA3_VOCAB, generator=torch.Generator().manual_seed(1)).to(device)  # [vocab]
    message = encode_tensor(logits)
    assert len(message.data) == LLAMA3_VOCAB * 4
    assert torch.equal(decode_tensor(message, device), logits)
    compressed = encode_tensor(logits.to(torch.bfloat16))
    assert len(compressed.data) == LLAMA3_VOCAB * 2
    assert torch.equal(decode_tensor(compressed, device), logits.to(torch.bfloat16))


def test_special_values_survive(device: torch.device) -> None:
    values = torch.tensor([float("inf"), float("-inf"), -0.0, 1e-45, 3.4e38])
    for dtype in (torch.float32, torch.bfloat16):
        sent = values.to(dtype)
        got = decode_tensor(encode_tensor(sent.to(device)))
        assert torch.equal(_bits(got), _bits(sent))
    nan = decode_tensor(encode_tensor(torch.tensor([float("nan")], device=device)))
    assert torch.isnan(nan).all()


def test_serialised_message_round_trip(device: torch.device) -> None:
    tensor = torch.randn(4, 9, device=device)
    wire_bytes = encode_tensor(tensor).SerializeToString()
    assert torch.equal(decode_tensor(common_pb2.Tensor.FromString(wire_bytes), device), tensor)


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
