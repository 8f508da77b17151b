"""Tensor <-> `specdec.v1.Tensor` codec: raw little-endian bytes plus dtype and shape.

Logits and probability vectors are the bulk of the traffic between the services
(one 128,256-wide row per verified position), so they travel as raw bytes and decode
without a per-element loop. bf16 has no numpy dtype: it travels as its uint16 bit
pattern and is reinterpreted with `Tensor.view`, which is bit-exact.
"""

from __future__ import annotations

import sys

import torch

from specdec.errors import InvalidArgumentError
from specdec.v1 import common_pb2

_TORCH_TO_WIRE: dict[torch.dtype, common_pb2.DType] = {
    torch.float32: common_pb2.DTYPE_FLOAT32,
    torch.bfloat16: common_pb2.DTYPE_BFLOAT16,
    torch.float16: common_pb2.DTYPE_FLOAT16,
}
_WIRE_TO_TORCH: dict[int, torch.dtype] = {v: k for k, v in _TORCH_TO_WIRE.items()}
# Same-width integer type used to move the raw bits through numpy.
_BITS_DTYPE: dict[torch.dtype, torch.dtype] = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}
_LITTLE_ENDIAN = sys.byteorder == "little"


def wire_dtype(dtype: torch.dtype) -> common_pb2.DType:
    """The `specdec.v1.DType` value for a torch dtype (InvalidArgumentError if unsupported)."""
    try:
        return _TORCH_TO_WIRE[dtype]
    except KeyError:
        raise InvalidArgumentError(f"dtype {dtype} cannot be sent on the wire") from None


def torch_dtype(wire: int) -> torch.dtype:
    """The torch dtype for a `specdec.v1.DType` value (InvalidArgumentError if unknown)."""
    try:
        return _WIRE_TO_TORCH[wire]
    except KeyError:
        raise InvalidArgumentError(f"unsupported tensor dtype {wire}") from None


def encode_tensor(tensor: torch.Tensor) -> common_pb2.Tensor:
    """Serialise `tensor` (any device) in its own dtype."""
    wire = wire_dtype(tensor.dtype)
    bits = tensor.detach().to("cpu").contiguous().view(_BITS_DTYPE[tensor.dtype]).numpy()
    if not _LITTLE_ENDIAN:
        bits = bits.byteswap()
    return common_pb2.Tensor(dtype=wire, shape=list(tensor.shape), data=bits.tobytes())


def decode_tensor(message: common_pb2.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """Rebuild the tensor a `specdec.v1.Tensor` carries, validating size against shape."""
    dtype = torch_dtype(message.dtype)
    shape = tuple(int(d) for d in message.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgumentError(f"tensor shape {shape} has a negative dimension")
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(message.data) != numel * itemsize:
        raise InvalidArgumentError(
            f"tensor data has {len(message.data)} bytes, shape {shape} of {dtype} needs {numel * itemsize}"
        )
    bits_dtype = _BITS_DTYPE[dtype]
    if numel == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    # frombuffer shares the immutable message bytes; clone so callers own writable memory.
    bits = torch.frombuffer(bytearray(message.data), dtype=bits_dtype)
    if not _LITTLE_ENDIAN:
        bits = torch.from_numpy(bits.numpy().byteswap())
    return bits.view(dtype).reshape(shape).to(device)
