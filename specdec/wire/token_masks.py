"""`TokenMasks` on the wire (common.proto `TokenMasks`): the packed words as they are."""

from __future__ import annotations

from specdec.sampling.token_masks import TokenMasks
from specdec.v1 import common_pb2


def token_masks_to_pb(masks: TokenMasks) -> common_pb2.TokenMasks:
    return common_pb2.TokenMasks(rows=masks.rows, words_per_row=masks.words.shape[1], words=masks.to_bytes())


def token_masks_from_pb(message: common_pb2.TokenMasks) -> TokenMasks:
    """INVALID_ARGUMENT when the byte count does not match the declared shape."""
    return TokenMasks.from_bytes(message.words, message.rows, message.words_per_row)
