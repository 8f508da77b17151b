"""Two gateways on one target/draft pair whose pools hold one gateway's full batch, on the real
stack: each gateway admits within the room the services last reported (as if the pools were
its own before any report); where gateways reserve their requests' growth, the target gives a
new slot only the blocks beyond it, and the services refuse what does not fit
(RESOURCE_EXHAUSTED with the capacity trailer); the gateways queue or preempt instead of
failing (with --reserve-kv-growth, none is preempted) — every answer is the target's greedy
output, and no slot is left behind."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from specdec.client import SpecdecClient
from specdec.model.runtime import ModelRuntime
from tests.support.stacks import StartStack

# Greedy keeps counting: no early EOS, so every request grows to its full length.
PROMPTS = [", ".join(str(n) for n in range(start, start + 4)) + "," for start in (1, 11, 21, 31, 41, 51)]
NEW_TOKENS = 40
# 12 blocks of 16: one gateway's 3 requests (prompt + 40 tokens + a round: 4 blocks each at the
# end) fit, two gateways' 6 do not.
POOL = dict(kv_token_budget=12 * 16, block_size=16)


def _metric_sum(metrics_port: int | None, keep: Callable[[Sample], bool]) -> float:
    """The sum of the samples `keep` picks at the Prometheus endpoint on `metrics_port`."""
    assert metrics_port is not None
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if keep(sample))


PREEMPTIONS, REFUSALS = "specdec_num_preemptions_total", "specdec_num_pool_refusals_total"


def _counter(metrics_port: int | None, name: str) -> float:
    """The gateway counter `name` at `metrics_port`, summed over its labels."""
    return _metric_sum(metrics_port, lambda sample: sample.name == name)


@pytest.mark.parametrize("reserve", [False, True], ids=["on-demand", "reserved"])
def test_two_gateways_share_pools_that_hold_one_batch_and_lose_nothing(
    reserve: bool, start_stack: StartStack, int8_runtime: ModelRuntime
) -> None:
    options: dict[str, Any] = dict(max_batch_size=3, num_speculative_tokens=4, metrics_port=0,
                                   reserve_kv_growth=reserve)
    stack = start_stack(int8_runtime, target=POOL, draft=POOL, **options)
    other = start_stack.add_gateway(stack, **options)
    with stack.client() as first, SpecdecClient(f"127.0.0.1:{other.port}", timeout=120) as second:
        references = [first.generate(p, max_new_tokens=NEW_TOKENS, speculative=False) for p in PROMPTS]
        clients = [first, second] * 3
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(client.generate, prompt, max_new_tokens=NEW_TOKENS)
                       for client, prompt in zip(clients, PROMPTS)]
            results = [future.result() for future in futures]  # an error reaching a client raises here
    assert [(r.token_ids, r.finish_reason) for r in results] == [(r.token_ids, r.finish_reason) for r in references]
    preempted = _counter(stack.gateway.metrics_port, PREEMPTIONS) + _counter(other.metrics_port, PREEMPTIONS)
    refused = _counter(stack.gateway.metrics_port, REFUSALS) + _counter(other.metrics_port, REFUSALS)
    if reserve:
        # Both gateways send their 3 at once. The first Prefill takes the pool's 12 blocks of
        # reserved growth on demand; the other is refused (a gateway refused holding nothing
        # backs off and tries one request at a time), and is admitted only when its request
        # fits at its whole length beside that growth: none is preempted.
        assert preempted == 0 and refused > 0
    else:
        # Both admit their 3 on demand, and 6 requests outgrow the pools: a gateway that heard
        # of the other's in time preempts; one that did not is refused.
        assert preempted + refused > 0
    stack.wait_until_idle()
    for engine in stack.engines():
        assert engine.cache.blocks.free_tokens == engine.cache.capacity_tokens


def _merged_calls(metrics_port: int | None, method: str) -> float:
    """`specdec_service_merged_calls_total{method}` of the service at `metrics_port`."""
    return _metric_sum(metrics_port, lambda sample: sample.name == "specdec_service_merged_calls_total"
                       and sample.labels["method"] == method)


@pytest.mark.parametrize("held", ["target", "draft"])
def test_two_gateways_calls_run_as_one_forward_with_exact_answers(
    held: str, start_stack: StartStack, int8_runtime: ModelRuntime
) -> None:
    """The services' call merger (docs/deployment.md#shared-pools): a Verify (a Propose) waits
    while the other gateway, which holds slots there too, drafts (verifies), and both run in
    one forward, each new slot under its own gateway's lease. One service's hold is pinned
    long and the other's off (held long at both, each would wait for the other's held call),
    so it ends only when the other gateway's call comes or its last slot goes: merging does
    not depend on how fast this machine runs a forward."""
    waits = {"target": 0.0, "draft": 0.0, held: 30.0}
    options: dict[str, Any] = dict(max_batch_size=3, num_speculative_tokens=4)
    stack = start_stack(int8_runtime, target=dict(metrics_port=0, merge_wait_s=waits["target"]),
                        draft=dict(metrics_port=0, merge_wait_s=waits["draft"]), **options)
    other = start_stack.add_gateway(stack, **options)
    with stack.client() as first, SpecdecClient(f"127.0.0.1:{other.port}", timeout=120) as second:
        references = [first.generate(p, max_new_tokens=NEW_TOKENS, speculative=False) for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(client.generate, prompt, max_new_tokens=NEW_TOKENS)
                       for client, prompt in zip([first, second] * 3, PROMPTS)]
            results = [future.result() for future in futures]
    assert [r.token_ids for r in results] == [r.token_ids for r in references]
    server, method = (stack.servers[0], "Verify") if held == "target" else (stack.servers[1], "Propose")
    assert _merged_calls(server.metrics_port, method) > 0
    stack.wait_until_idle()
