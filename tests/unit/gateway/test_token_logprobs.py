"""Which of the target's rows a round's emitted tokens take, and refusing rows that do not fit
what the gateway asked (no services: answers built by hand)."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import ServiceStateError
from specdec.gateway.detokenizer import StopStringDetokenizer
from specdec.gateway.request import Request
from specdec.gateway.token_logprobs import round_logprobs
from specdec.sampling.logprobs import LogprobsRequest, RowLogprobs, TokenLogprob
from specdec.sampling.params import SamplingParams
from specdec.wire.items import Proposal, VerifiedArgmax, VerifiedDecode

ROWS = RowLogprobs(drafted=[-0.1, -0.2, -0.3], answered=[-1.0, -2.0, -3.0, -4.0],
                   top=[[(10 + i, -0.05)] for i in range(4)])


def seq(slot: str, top: int | None = 1) -> Request:
    greedy = SamplingParams(temperature=0.0)
    return Request(
        slot_id=slot, prompt=[1, 2, 3], sampling=greedy, max_new_tokens=100, num_speculative_tokens=3,
        detokenizer=StopStringDetokenizer.__new__(StopStringDetokenizer), generator=torch.Generator(),
        draft_sampling=greedy, target_sampling=greedy, logprobs=None if top is None else LogprobsRequest(top),
    )


def test_accepted_draft_tokens_then_the_rows_answer() -> None:
    seqs = [seq("spec"), seq("plain"), seq("none", top=None)]
    proposals = {"spec": Proposal("spec", [7, 8, 9], None, 3), "none": Proposal("none", [7], None, 3)}
    verified = {"spec": VerifiedArgmax("spec", 7, [7, 5, 6, 4], ROWS), "plain": VerifiedDecode("plain", 5, [3, 4],
                RowLogprobs([], [-1.0, -2.0], [[(3, -1.0)], [(4, -2.0)]])), "none": VerifiedArgmax("none", 5, [7, 1])}
    accepted = {"spec": [7, 5], "none": [7, 1]}
    out = round_logprobs(seqs, proposals, verified, accepted)
    assert out == {
        "spec": [TokenLogprob(7, -0.1, ((10, -0.05),)), TokenLogprob(5, -2.0, ((11, -0.05),))],
        "plain": [TokenLogprob(3, -1.0, ((3, -1.0),)), TokenLogprob(4, -2.0, ((4, -2.0),))],
    }


@pytest.mark.parametrize("rows", [None, RowLogprobs([-0.1], [-1.0, -2.0], [[(1, -1.0)], [(2, -2.0)]]),
                                  RowLogprobs([], [-1.0, -2.0, -3.0, -4.0], [[]] * 4)],
                         ids=["missing", "too-few-rows", "no-alternatives"])
def test_rows_that_do_not_fit_the_question_fail_the_round(rows: RowLogprobs | None) -> None:
    with pytest.raises(ServiceStateError, match="malformed logprobs"):
        round_logprobs([seq("spec")], {"spec": Proposal("spec", [7, 8, 9], None, 3)},
                       {"spec": VerifiedArgmax("spec", 7, [7, 5, 6, 4], rows)},
                       {"spec": [7, 5]})
