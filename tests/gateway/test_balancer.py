"""Two gateways on one target/draft pair behind a real HAProxy (`specdec_bench.balancer`): a
gateway that drains under load loses no request, the requests it refuses succeed on the
other, and every answer is plain decoding's. `python -m specdec_bench.balancer` (`make
balancer`) is the long run, with a target restart too."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from specdec_bench.balancer import Backend, Load, haproxy_binary, references, running_haproxy, summary
from tests.support.services import StartGateway, StartService, eventually, slow_down

pytestmark = pytest.mark.skipif(haproxy_binary() is None,
                                reason="haproxy is not installed (make test installs it)")

STREAMS, TOKENS, PROMPTS = 6, 16, 3


def test_a_draining_gateway_behind_haproxy_loses_no_request(
    start_target: StartService, start_draft: StartService, start_gateway: StartGateway,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    target, draft = start_target(), start_draft()
    with ThreadPoolExecutor(2) as pool:  # both start at once
        gateways = list(pool.map(lambda _: start_gateway(target, draft), range(2)))
    with running_haproxy([Backend.of(g) for g in gateways]) as lb:
        expected = references(lb, TOKENS, PROMPTS)
        slow_down(monkeypatch, target.engine, "verify", 0.05)  # streams take seconds on any machine
        load = Load(lb, STREAMS, TOKENS, PROMPTS)
        assert eventually(lambda: len(target.engine.tokens) >= STREAMS), "the streams never started"
        gateways[0].process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert gateways[0].process.wait(timeout=120) == 0  # drained, then exited by itself
        time.sleep(1.0)  # requests keep coming after it left
        outcomes = load.stop()
    result = summary(outcomes, expected)
    assert result["lost"] == 0, result
    assert result["greedy_exact"] == f"{len(outcomes)}/{len(outcomes)}", result
    # Requests were sent while the gateway drained, not only before.
    assert any(o.sent > signalled for o in outcomes), result
    assert eventually(lambda: not target.engine.tokens and not draft.engine.tokens)
