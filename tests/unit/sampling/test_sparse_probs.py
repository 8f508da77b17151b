"""The draft's q with its tail cut, and the sparse rows it travels as."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import InvalidArgumentError
from specdec.sampling.sparse_probs import MIN_DRAFT_PROB, SparseRows, cut_tail
from specdec.wire.items import sparse_from_pb, sparse_to_pb


@pytest.mark.device_agnostic
def test_cut_tail_drops_small_probabilities_and_keeps_each_rows_largest(device: torch.device) -> None:
    probs = torch.tensor([
        [0.5, 0.4999, MIN_DRAFT_PROB / 2, MIN_DRAFT_PROB, 0.0],
        [MIN_DRAFT_PROB / 3] * 4 + [MIN_DRAFT_PROB / 2],  # every entry below the threshold
    ], device=device)
    cut = cut_tail(probs).cpu()
    assert torch.equal(cut[0], torch.tensor([0.5, 0.4999, 0.0, MIN_DRAFT_PROB, 0.0]))
    assert torch.equal(cut[1], torch.tensor([0.0] * 4 + [MIN_DRAFT_PROB / 2]))


@pytest.mark.device_agnostic
def test_rows_round_trip_through_the_wire_and_normalize_alike(device: torch.device) -> None:
    """The draft's rows on its device go to the wire; the target reads them onto its own."""
    dense = torch.tensor([[0.0, 2.0, 0.0, 1.0], [0.5, 0.0, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]]).to(torch.bfloat16)
    rows = SparseRows.from_dense(dense.to(device))
    assert rows.lengths == (2, 1, 4) and rows.token_ids.tolist() == [1, 3, 0, 0, 1, 2, 3]
    wire = sparse_from_pb(sparse_to_pb(rows))
    assert wire.lengths == rows.lengths and torch.equal(wire.token_ids, rows.token_ids.cpu())
    assert wire.values.dtype == torch.bfloat16 and torch.equal(wire.values, rows.values.cpu())
    wire.validate(4, "q")
    assert wire.distributions(4, device=device).device.type == device.type
    q = wire.distributions(4, extra_rows=1)  # [4, 4]
    torch.testing.assert_close(q[:3], dense.float() / dense.float().sum(-1, keepdim=True), atol=0, rtol=1e-6)
    assert torch.equal(q[3], torch.zeros(4))
    tokens = [3, 0, 2]
    assert torch.equal(wire.probs_of(tokens), q[torch.arange(3), torch.tensor(tokens)])  # one computation
    assert wire.probs_of([2, 0, 2])[0] == 0  # outside the row's support


@pytest.mark.parametrize(
    "lengths, ids, values, words",
    [
        ((2,), [1], [1.0], "add up"),
        ((0, 1), [1], [1.0], "add up"),
        ((1,), [4], [1.0], "token ids"),
        ((1,), [-1], [1.0], "token ids"),
        ((2,), [1, 2], [1.0, float("nan")], "finite"),
        ((2,), [1, 2], [1.0, -0.5], "non-negative"),
        ((2,), [1, 1], [0.5, 0.5], "twice"),
        ((1,), [1], [0.0], "positive sum"),
    ],
)
def test_malformed_rows_are_invalid_arguments(lengths: tuple[int, ...], ids: list[int], values: list[float],
                                              words: str) -> None:
    rows = SparseRows(lengths, torch.tensor(ids), torch.tensor(values))
    with pytest.raises(InvalidArgumentError, match=words) as error:
        rows.validate(4, "draft_probs")
    assert "draft_probs" in str(error.value)
