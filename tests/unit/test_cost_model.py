"""The speed model: cost-table interpolation, expected tokens per round, Thm 3.8's speedup."""

from __future__ import annotations

import math

import pytest

from specdec.cost_model import CostTable, ForwardCost, RoundCostModel, expected_speedup, expected_tokens

GRID = [
    ForwardCost(1, 1, 0.010), ForwardCost(1, 5, 0.014), ForwardCost(1, 9, 0.020),
    ForwardCost(4, 1, 0.016), ForwardCost(4, 5, 0.040),
]


def test_table_hits_measured_points_and_interpolates_between_them() -> None:
    table = CostTable(GRID)
    for cost in GRID:
        assert table.seconds(cost.batch_size, cost.tokens) == pytest.approx(cost.seconds)
    assert table.seconds(1, 3) == pytest.approx(0.012)  # halfway between 1 and 5 tokens
    assert table.seconds(2, 1) == pytest.approx(0.012)  # a third of the way from batch 1 to 4
    assert table.seconds(4, 9) == pytest.approx(0.064)  # past the grid: the last segment extended
    assert table.scaled(2.0).seconds(1, 5) == pytest.approx(0.028)


def test_a_shared_table_prices_the_forward_its_rows_run_in() -> None:
    table = CostTable(GRID)
    merged = table.shared(2.0)  # another gateway's calls carry as many rows again
    assert merged.seconds(2, 5) == pytest.approx(table.seconds(4, 5)) == pytest.approx(0.040)
    assert merged.scaled(2.0).step(1) == pytest.approx(2 * table.step(2))
    assert table.seconds(2, 5) == pytest.approx(0.014 + 0.026 / 3)  # the original is untouched


def test_a_longer_context_adds_a_cost_per_cached_token_and_request() -> None:
    # Measured at 48 tokens of context; two points again at 304: 20 and 40 µs per token and request.
    long = [ForwardCost(4, 1, 0.016 + 4 * 256 * 20e-6, context=304),
            ForwardCost(4, 5, 0.040 + 4 * 256 * 40e-6, context=304)]
    table = CostTable([ForwardCost(c.batch_size, c.tokens, c.seconds, context=48) for c in GRID] + long)
    assert table.has_context_term and table.base_context == 48
    assert table.seconds(4, 5) == pytest.approx(0.040)  # the grid prices its own context
    at_176 = table.at_context(176)
    assert at_176.seconds(4, 1) == pytest.approx(0.016 + 4 * 128 * 20e-6)
    assert at_176.seconds(1, 3) == pytest.approx(0.012 + 1 * 128 * 30e-6)  # the slope interpolated in tokens
    assert at_176.scaled(2.0).seconds(4, 1) == pytest.approx(2 * (0.016 + 4 * 128 * 20e-6))
    assert table.at_context(16).seconds(1, 1) == pytest.approx(0.010 - 32 * 20e-6)  # a shorter context costs less
    # Without long-context points (an older service) the context changes nothing.
    assert CostTable(GRID).at_context(1000).seconds(4, 5) == pytest.approx(0.040)
    assert not CostTable(GRID).has_context_term


def test_past_the_widest_chunk_each_token_reads_the_context_at_its_cost() -> None:
    # 20 µs per context token at 1 token, 40 at 5: a 50-token chunk pays 40 / 5 µs a token, not
    # the line through the two slopes, which would grow with the square of a prompt-sized chunk.
    long = [ForwardCost(4, 1, 0.016 + 4 * 256 * 20e-6, context=304),
            ForwardCost(4, 5, 0.040 + 4 * 256 * 40e-6, context=304)]
    table = CostTable([ForwardCost(c.batch_size, c.tokens, c.seconds, context=48) for c in GRID] + long)
    assert table.at_context(176).context_seconds(1, 50) == pytest.approx(128 * 50 * 8e-6)


def test_a_longer_measured_context_bends_the_context_cost() -> None:
    # 20 µs per context token and request from 48 to 304 tokens; at 2,096 the step cost 50 µs
    # per token more than at 48 (the cached K/V outgrew the caches): 62.5 µs per token past 304.
    costs = [ForwardCost(c.batch_size, c.tokens, c.seconds, context=48) for c in GRID] + [
        ForwardCost(4, 1, 0.016 + 4 * 256 * 20e-6, context=304),
        ForwardCost(1, 1, 0.010 + 2048 * 50e-6, context=2096),
    ]
    table = CostTable(costs)
    assert table.at_context(176).seconds(1, 1) == pytest.approx(0.010 + 128 * 20e-6)  # the first piece
    past_304 = (2048 * 50e-6 - 256 * 20e-6) / 1792
    assert table.at_context(1200).seconds(1, 1) == pytest.approx(0.010 + 256 * 20e-6 + 896 * past_304)
    assert table.at_context(2096).seconds(1, 1) == pytest.approx(0.010 + 2048 * 50e-6)  # as measured
    assert table.at_context(3000).seconds(2, 1) == pytest.approx(  # on along the last piece, per request
        table.seconds(2, 1) + 2 * (2048 * 50e-6 + 904 * past_304))
    # A longer context never prices cheaper than a shorter one, whatever the noise measured.
    noisy = CostTable(costs[:-1] + [ForwardCost(1, 1, 0.010 + 2048 * 1e-6, context=2096)])
    assert noisy.at_context(2096).seconds(1, 1) == pytest.approx(noisy.at_context(304).seconds(1, 1))


def test_context_slopes_pool_the_batch_sizes() -> None:
    # 1 request: 2 ms more over 256 tokens (noise-sized); 16 requests: 82 ms more.
    costs = [ForwardCost(1, 1, 0.010, context=48), ForwardCost(16, 1, 0.030, context=48),
             ForwardCost(1, 1, 0.012, context=304), ForwardCost(16, 1, 0.112, context=304)]
    table = CostTable(costs).at_context(304)
    pooled = (0.002 + 0.082) / (17 * 256)
    assert table.seconds(8, 1) - CostTable(costs).seconds(8, 1) == pytest.approx(8 * 256 * pooled)


def test_a_noisy_table_never_makes_more_tokens_cheaper() -> None:
    # Start-up timings are noisy: here the 2-token forward timed below the 1-token one.
    table = CostTable([ForwardCost(1, 1, 0.058), ForwardCost(1, 2, 0.056), ForwardCost(1, 5, 0.066)])
    assert table.seconds(1, 2) == pytest.approx(0.058)
    assert table.seconds(1, 1.5) == pytest.approx(0.058)
    assert table.seconds(1, 5) == pytest.approx(0.066)


def test_one_outlier_among_verify_widths_does_not_bend_the_verify_slope() -> None:
    # 2..9 tokens cost 40 ms + 2 ms per token, but the 2-token forward timed 10 ms slow.
    measured = {1: 0.041, 2: 0.054, 3: 0.046, 5: 0.050, 9: 0.058, 64: 0.200}
    table = CostTable([ForwardCost(1, t, s) for t, s in measured.items()])
    assert table.seconds(1, 1) == pytest.approx(0.041)  # the 1-token step stays as measured
    assert table.seconds(1, 64) == pytest.approx(0.200)  # and so does the prompt-sized chunk
    truth = {t: 0.040 + 0.002 * t for t in (2, 3, 5, 9)}
    fitted = {t: table.seconds(1, t) for t in truth}
    assert abs(fitted[2] - truth[2]) < 0.55 * abs(measured[2] - truth[2])  # pulled halfway back
    assert max(abs(fitted[t] - truth[t]) for t in truth) < abs(measured[2] - truth[2])
    assert list(fitted.values()) == sorted(fitted.values())


def test_expected_tokens_matches_the_closed_form() -> None:
    for alpha in (0.0, 0.3, 0.9):
        for k in range(6):
            closed = (1 - alpha ** (k + 1)) / (1 - alpha)
            assert expected_tokens([alpha], k) == pytest.approx(closed)
    assert expected_tokens([0.9, 0.5], 3) == pytest.approx(1 + 0.9 + 0.45 + 0.225)  # last entry repeats


def test_expected_speedup_is_theorem_3_8_with_verify_cost() -> None:
    assert expected_speedup(0.9, 0, 0.2, 0.05) == 1.0
    assert expected_speedup(0.9, 4, 0.0, 0.0) == pytest.approx((1 - 0.9**5) / 0.1)
    assert expected_speedup(0.9, 4, 0.2, 0.05) == pytest.approx(4.0951 / 2.0)
    # One draft token pays exactly when alpha > c + s.
    assert expected_speedup(0.30, 1, 0.2, 0.05) > 1 > expected_speedup(0.20, 1, 0.2, 0.05)


def test_round_cost_counts_each_draft_step_over_the_requests_still_drafting() -> None:
    target = CostTable([ForwardCost(1, 1, 0.010), ForwardCost(1, 9, 0.018), ForwardCost(4, 1, 0.010),
                        ForwardCost(4, 9, 0.018)])
    draft = CostTable([ForwardCost(1, 1, 0.002), ForwardCost(4, 1, 0.005)])
    model = RoundCostModel(target=target, draft=draft, overhead_s=0.001)
    assert model.round_seconds([0, 0]) == pytest.approx(0.011)  # plain: one 1-token verify
    # ks [4, 2]: draft steps 1-2 run both requests, steps 3-4 one; verify at 1 + 4 tokens per
    # request, the narrower row padded to the wider.
    expected = 0.001 + 0.014 + 2 * draft.step(2) + 2 * draft.step(1)
    assert model.round_seconds([4, 2]) == pytest.approx(expected)
    rate = model.tokens_per_second([4, 2], [[0.5], [1.0]])
    assert math.isclose(rate, (expected_tokens([0.5], 4) + 3) / expected)
    wire = RoundCostModel(target, draft, overhead_s=0.001, draft_round_overhead_s=0.002, draft_token_overhead_s=0.0005)
    assert wire.round_seconds([0, 0]) == pytest.approx(0.011)  # plain rounds pay no draft overhead
    assert wire.round_seconds([4, 2]) == pytest.approx(expected + 0.002 + 6 * 0.0005)


def test_the_first_draft_step_also_feeds_the_tokens_the_draft_has_not_seen() -> None:
    target = CostTable([ForwardCost(1, 1, 0.010), ForwardCost(1, 9, 0.018)])
    draft = CostTable([ForwardCost(b, t, 0.002 * b * (1 + 0.8 * (t - 1))) for b in (1, 2) for t in (1, 2)])
    model = RoundCostModel(target=target, draft=draft)
    assert draft.seconds(1, 2) > draft.step(1)
    assert model.draft_seconds([3]) == pytest.approx(3 * draft.step(1))  # by default a 1-token feed
    assert model.draft_seconds([3], feeds=[2]) == pytest.approx(draft.seconds(1, 2) + 2 * draft.step(1))
    # Two requests drafting, one feeding 2 tokens: the first step runs both, 1.5 tokens each on average.
    assert model.draft_seconds([2, 1], feeds=[2, 1]) == pytest.approx(draft.seconds(2, 1.5) + draft.step(1))
    # A request decoding plainly feeds the draft nothing this round.
    assert model.draft_seconds([0, 2], feeds=[2, 1]) == pytest.approx(2 * draft.step(1))
    assert model.round_seconds([3], feeds=[2]) == pytest.approx(model.verify_seconds([3])
                                                                + model.draft_seconds([3], [2]))


def test_a_multi_step_plain_round_costs_one_step_per_decoded_token_and_one_overhead() -> None:
    target = CostTable([ForwardCost(1, 1, 0.010), ForwardCost(1, 9, 0.018), ForwardCost(4, 1, 0.016),
                        ForwardCost(4, 9, 0.040)])
    model = RoundCostModel(target=target, draft=None, overhead_s=0.002)
    # Steps [4, 2]: two steps over both requests, two over one.
    assert model.verify_seconds([0, 0], steps=[4, 2]) == pytest.approx(2 * target.step(2) + 2 * target.step(1))
    assert model.round_seconds([0, 0], steps=[4, 2]) == pytest.approx(0.002 + 2 * target.step(2) + 2 * target.step(1))
    assert model.tokens_per_second([0, 0], [[0.9], [0.9]], steps=[4, 2]) == pytest.approx(
        6 / model.round_seconds([0, 0], steps=[4, 2])
    )
    # The overhead is paid once a round: four steps a call beat one.
    assert model.tokens_per_second([0], [[0.9]], steps=[4]) > model.tokens_per_second([0], [[0.9]])
    # Steps price plain rounds only; a round that drafts verifies once.
    assert model.verify_seconds([2, 0], steps=[4, 4]) == pytest.approx(model.verify_seconds([2, 0]))
    assert (model.tokens_per_second([2, 0], [[0.9], [0.9]], steps=[4, 4])
            == model.tokens_per_second([2, 0], [[0.9], [0.9]]))
