"""Comparing our batched sampling transforms with per-row references (transformers' processors).

On the CPU the two run the same operations in the same order, so they agree bit for bit. On
CUDA, a tensor divided by a Python number is multiplied by its reciprocal instead, which can
round the last bit differently from the true division our batched code does with a tensor of
divisors; there the check is: the same tokens cut, and every value within a few ulps.
"""

from __future__ import annotations

import torch

#: Relative tolerance off the CPU: a reciprocal's rounding, carried through a softmax.
RELATIVE_TOLERANCE = 1e-5


def assert_matches_reference(ours: torch.Tensor, reference: torch.Tensor, context: object = None) -> None:
    """`ours` equals `reference` (bit for bit on the CPU; see the module's note for other devices)."""
    if ours.device.type == "cpu":
        assert torch.equal(ours, reference), context
        return
    assert torch.equal(ours == 0, reference == 0), ("a different set of tokens cut", context)
    torch.testing.assert_close(ours, reference, rtol=RELATIVE_TOLERANCE, atol=0, msg=lambda m: f"{m}\n{context}")
