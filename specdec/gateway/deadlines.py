"""How long the gateway waits for each call to a model service.

A deadline is `factor` times the call's expected compute, from the cost tables the
services measured at start-up, and never less than `floor_s`. Without cost tables (a
service started with --no-measure-costs) every call gets the floor. The factor is large:
the point is to notice a service that has stopped answering (hung, paused, partitioned)
within seconds, not to cut off a slow but working one.

A service that is still loading compiled graphs after its start-up (its Info's pending graphs)
runs a call after the graph in hand, so its calls get `GRAPH_LOAD_S` more: without it the
requests of the first seconds after a start failed with DEADLINE_EXCEEDED.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from specdec.cost_model import CostTable

#: What a call may wait behind one compiled graph's loading (its compilation from inductor's
#: cache, with both cores shared): the most measured here was a few tens of seconds.
GRAPH_LOAD_S = 60.0


@dataclass(frozen=True)
class Deadlines:
    floor_s: float
    factor: float
    target: CostTable | None = None
    draft: CostTable | None = None
    #: Largest tokens-per-request the tables were measured at; beyond it costs grow linearly.
    table_tokens: int = 9
    #: The services ("target", "draft") still loading compiled graphs.
    loading: frozenset[str] = frozenset()

    def with_loading(self, service: str, loading: bool) -> Deadlines:
        """These deadlines with `service` loading compiled graphs or done."""
        return replace(self, loading=self.loading | {service} if loading else self.loading - {service})

    def _allowance(self, service: str) -> float:
        return GRAPH_LOAD_S if service in self.loading else 0.0

    def _expected(self, table: CostTable | None, batch: int, tokens: int) -> float:
        if table is None or batch <= 0:
            return 0.0
        if tokens <= self.table_tokens:
            return table.seconds(batch, max(tokens, 1))
        return table.seconds(batch, self.table_tokens) * tokens / self.table_tokens

    def _deadline(self, expected_s: float) -> float:
        return max(self.floor_s, self.factor * expected_s)

    def prefill(self, batch: int, longest_prompt: int) -> float:
        return self._deadline(self._expected(self.target, batch, longest_prompt)) + self._allowance("target")

    def verify(self, batch: int, longest_chunk: int, decode_steps: int = 1) -> float:
        """The chunk's forward, then the one-token forwards of multi-step decoding."""
        steps = (decode_steps - 1) * self._expected(self.target, batch, 1)
        return self._deadline(self._expected(self.target, batch, longest_chunk) + steps) + self._allowance("target")

    def propose(self, batch: int, longest_feed: int, k: int) -> float:
        """A feed of the new tokens (a whole prompt on first sight), then K one-token steps."""
        feed = self._expected(self.draft, batch, longest_feed)
        return self._deadline(feed + k * self._expected(self.draft, batch, 1)) + self._allowance("draft")

    def control(self) -> float:
        """Info, Release, health: no model work."""
        return self.floor_s
