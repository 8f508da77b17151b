"""Keys and values moved from one service's cache to another's (`TargetService.ExportKV`,
`DraftService.ImportKV`): the header of an import, and a cache's rows cut into pieces and
put back together.

A transfer is `[layers, positions, 2, kv_heads, head_dim]`. It travels layer by layer in
pieces of at most `PIECE_BYTES`, so no message nears the services' message limits whatever
the context length, and the receiver checks that the pieces cover every layer and position
exactly once before anything is written.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from specdec.errors import InvalidArgumentError
from specdec.v1 import common_pb2, draft_pb2, target_pb2
from specdec.wire.items import Lease
from specdec.wire.tensor_codec import decode_tensor, encode_tensor, wire_dtype

#: The most bytes of keys and values one piece carries.
PIECE_BYTES = 1 << 20


@dataclass(frozen=True)
class KVExport:
    """What an export sends: positions [start, end) of `slot_id`'s first `num_layers`
    layers, in `dtype`."""

    slot_id: str
    start: int
    end: int
    num_layers: int
    dtype: torch.dtype

    def to_pb(self) -> target_pb2.ExportKVRequest:
        return target_pb2.ExportKVRequest(slot_id=self.slot_id, start=self.start, end=self.end,
                                          num_layers=self.num_layers, dtype=wire_dtype(self.dtype))


@dataclass(frozen=True)
class ImportHeader:
    """What an import fills: `tokens` of `slot_id` from position `valid_len` on (the slot is
    rolled back there first; a new slot needs `valid_len` 0 and is held under `lease`)."""

    slot_id: str
    valid_len: int
    tokens: list[int]
    lease: Lease | None = None
    #: For a slot this import creates: the most tokens it will hold, as `PrefillItem.max_len`.
    max_len: int = 0

    def to_pb(self) -> draft_pb2.ImportKVRequest:
        header = draft_pb2.ImportKVHeader(slot_id=self.slot_id, valid_len=self.valid_len, tokens=self.tokens,
                                          max_len=self.max_len)
        if self.lease is not None:
            header.lease.CopyFrom(self.lease.to_pb())
        return draft_pb2.ImportKVRequest(header=header)

    @classmethod
    def from_pb(cls, message: draft_pb2.ImportKVHeader) -> ImportHeader:
        return cls(message.slot_id, message.valid_len, list(message.tokens), Lease.from_pb(message.lease),
                   message.max_len)


def split_pieces(kv: torch.Tensor, piece_bytes: int = PIECE_BYTES) -> Iterator[common_pb2.KVPiece]:
    """`kv` [layers, positions, 2, kv_heads, head_dim] as pieces of at most `piece_bytes`
    (at least one position each), layer by layer."""
    layers, positions = kv.shape[0], kv.shape[1]
    row_bytes = kv[0, :1].numel() * kv.element_size() if positions else 1
    step = max(1, piece_bytes // row_bytes)
    for layer in range(layers):
        for start in range(0, positions, step):
            yield common_pb2.KVPiece(layer=layer, start=start, kv=encode_tensor(kv[layer, start : start + step]))


def assemble_pieces(
    pieces: Iterable[common_pb2.KVPiece], shape: tuple[int, int, int, int, int], dtype: torch.dtype
) -> torch.Tensor:
    """The `shape` [layers, positions, 2, kv_heads, head_dim] tensor in `dtype` that `pieces`
    cover. InvalidArgumentError unless they cover every layer and position exactly once
    with rows of the right shape."""
    layers, positions, *row = shape
    out = torch.empty(shape, dtype=dtype)
    covered = torch.zeros(layers, positions, dtype=torch.bool)
    for piece in pieces:
        kv = decode_tensor(piece.kv)  # [count, 2, kv_heads, head_dim]
        if kv.dim() != 4 or list(kv.shape[1:]) != row:
            raise InvalidArgumentError(f"KV piece of layer {piece.layer}: rows of shape {list(kv.shape[1:])}, "
                                       f"this cache holds {row}")
        end = piece.start + kv.shape[0]
        if not (0 <= piece.layer < layers and 0 <= piece.start and end <= positions):
            raise InvalidArgumentError(f"KV piece of layer {piece.layer}, positions [{piece.start}, {end}): "
                                       f"outside {layers} layers and {positions} positions")
        if covered[piece.layer, piece.start : end].any():
            raise InvalidArgumentError(f"KV piece of layer {piece.layer} repeats positions of [{piece.start}, {end})")
        covered[piece.layer, piece.start : end] = True
        out[piece.layer, piece.start : end] = kv
    if not covered.all():
        missing = int((~covered).sum())
        raise InvalidArgumentError(f"KV import: {missing} of {layers * positions} layer positions were not sent")
    return out
