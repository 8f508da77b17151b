"""Exploration: no draft source stays off on an estimate that nothing refreshes.

The planner's estimates of a source (its acceptance, the draft's step cost and overhead) come
from the rounds that draft with it, so a first estimate that says "off" would never be
corrected. Each source the planner can switch off (`PLANNED_SOURCES`) therefore has a
`SourceTrack`: its state (drafting / off / probing), why it last switched, and a probe
schedule that does not ask the estimates. After `FIRST_PROBE_ROUNDS` candidate rounds off, one
request drafts `PROBE_K` tokens from it anyway; each probe that does not turn it back on
doubles the wait, up to `MAX_PROBE_ROUNDS`, and a probe after the first may spend at most
`PROBE_BUDGET` of the decoding time since the last one. A service that restarts starts the schedule afresh. Probes
are what refresh the estimates: a stale estimate weighs a new sample more (`estimates`).

A request kept at K = 0 while its source drafts for others is probed on its own
(`RequestProbes`): that decision rests on its own acceptance, which only its rounds teach.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec.gateway.draft_sources import DraftSource
from specdec.gateway.planner.status import PLANNED_SOURCES, SourceState, SwitchReason
from specdec.gateway.request import Request

log = logging.getLogger(__name__)

#: Candidate rounds in a row without drafting before a source counts as off (a lookup that
#: pays now and then is on), and before its first probe; the wait doubles up to the maximum.
OFF_AFTER_ROUNDS = 32
FIRST_PROBE_ROUNDS = 32
MAX_PROBE_ROUNDS = 128
#: A probe may cost at most this share of the decoding seconds since the source's last probe.
PROBE_BUDGET = 0.02
#: Draft tokens of a probe; a model probe lasts two rounds, so its second one measures a step
#: without the first one's catch-up.
PROBE_K = 2
MODEL_PROBE_ROUNDS = 2


@dataclass
class SourceTrack:
    """One source's state and probe schedule (see the module docstring)."""

    source: DraftSource
    #: Drafting until the planner first decides otherwise: what its priors say of every source.
    state: SourceState = SourceState.DRAFTING
    #: Why it last switched (None before its first decision).
    reason: SwitchReason | None = None
    #: Decoding seconds since it last drafted on its merits (probes do not reset it).
    off_s: float = 0.0
    #: Candidate rounds since it last drafted on its merits or was probed.
    rounds_off: int = 0
    interval: int = FIRST_PROBE_ROUNDS
    #: Decoding seconds since its last probe (the probe budget's base).
    since_probe_s: float = 0.0
    #: Whether it was probed since the start or its service's last restart: the first probe
    #: goes ahead whatever it costs (the priors alone must not keep a source from ever being measured).
    probed: bool = False
    #: The request a running probe drafts for, and the probe's rounds left.
    probe_slot: str | None = None
    probe_rounds_left: int = 0
    switches: dict[SwitchReason, int] = field(default_factory=lambda: dict.fromkeys(SwitchReason, 0))

    @property
    def next_probe_rounds(self) -> int:
        return max(0, self.interval - self.rounds_off) if self.state is not SourceState.DRAFTING else 0

    def may_probe(self) -> bool:
        """Whether a probe may run now, whatever it costs: one is under way, or the source has
        been off long enough (`probe_due` then weighs its price)."""
        return self.probe_rounds_left > 0 or (
            self.state is SourceState.OFF and self.reason is not SwitchReason.DRAFT_FAILURE
            and self.rounds_off >= self.interval)

    def probe_due(self, price_s: float) -> bool:
        """Whether a probe costing `price_s` may run now: off long enough, and within budget."""
        if self.probe_rounds_left > 0:
            return True
        return self.may_probe() and (not self.probed or price_s <= PROBE_BUDGET * self.since_probe_s)

    def start_probe(self, slot_id: str) -> None:
        if self.probe_rounds_left == 0:
            self.probe_slot, self.rounds_off, self.since_probe_s, self.probed = slot_id, 0, 0.0, True
            self.probe_rounds_left = MODEL_PROBE_ROUNDS if self.source is DraftSource.MODEL else 1
            log.debug("planner: probing %s (off %.1f s, next wait %d rounds)", self.source.value, self.off_s,
                      min(2 * self.interval, MAX_PROBE_ROUNDS))
        self.probe_rounds_left -= 1
        self.state = SourceState.PROBING

    def decide(self, drafted: bool, cause: Callable[[], SwitchReason], numbers: Callable[[], str]) -> None:
        """A round with candidates for this source was planned: it `drafted` on its merits or not.
        Off after `OFF_AFTER_ROUNDS` such rounds without drafting (at once for a first decision,
        or after a draft failure); a finished probe that did not turn it on doubles the wait."""
        if drafted:
            self.rounds_off, self.interval, self.probe_rounds_left = 0, FIRST_PROBE_ROUNDS, 0
            if self.state is not SourceState.DRAFTING or self.reason is None:
                self._switch(SourceState.DRAFTING, SwitchReason.PAYS, numbers)
            self.off_s = 0.0
            return
        self.rounds_off += 1
        if self.state is SourceState.PROBING and self.probe_rounds_left == 0:
            self.state, self.interval = SourceState.OFF, min(2 * self.interval, MAX_PROBE_ROUNDS)
        settled = self.state is SourceState.DRAFTING and self.rounds_off >= OFF_AFTER_ROUNDS
        if settled or self.reason in (None, SwitchReason.DRAFT_FAILURE):
            self._switch(SourceState.OFF, cause(), numbers)

    def unavailable(self, numbers: Callable[[], str]) -> None:
        """Its service failed or is refused: off at once, without probes (its health check decides)."""
        self.probe_rounds_left = 0
        if self.reason is not SwitchReason.DRAFT_FAILURE:
            self._switch(SourceState.OFF, SwitchReason.DRAFT_FAILURE, numbers)

    def _switch(self, state: SourceState, reason: SwitchReason, numbers: Callable[[], str]) -> None:
        was = self.state if self.reason is not None else None
        self.state, self.reason = state, reason
        self.switches[reason] += 1
        # The model draft's switches show at a server's default level (they are rare: a source
        # counts as off only after OFF_AFTER_ROUNDS); a lookup's come and go with the text.
        level = logging.WARNING if self.source is DraftSource.MODEL and was is not None else logging.INFO
        log.log(level, "planner: %s %s -> %s (%s), %.1f s of decoding since it last drafted; %s", self.source.value,
                was.value if was is not None else "start", state.value, reason.value, self.off_s, numbers())

    def restarted(self) -> None:
        """Its service (re)started: probe soon, whatever earlier probes found."""
        self.interval, self.probed = FIRST_PROBE_ROUNDS, False

    def ran(self, seconds: float) -> None:
        """A round with candidates for it took `seconds` while it was not drafting on merits."""
        self.off_s += seconds
        self.since_probe_s += seconds


def new_tracks(with_model: bool) -> dict[DraftSource, SourceTrack]:
    """A track per source the planner may switch: the lookups, and the model draft `with_model`."""
    return {source: SourceTrack(source) for source in PLANNED_SOURCES if with_model or source is not DraftSource.MODEL}


@dataclass
class RequestProbes:
    """Per-request probes: a request kept at K = 0 by choice drafts `probe_k` tokens every
    `every` of its rounds, the wait doubling up to `max_every` while probes do not turn it back
    on. A due request not worth probing is asked again after as many rounds as the batch has
    candidates: about one question per round in any batch (each is a dozen rate predictions)."""

    every: int = 16
    max_every: int = 256
    probe_k: int = 2
    _idle: dict[str, int] = field(default_factory=dict)
    _interval: dict[str, int] = field(default_factory=dict)
    _probing: set[str] = field(default_factory=set)

    def schedule(self, candidates: list[Request], ks: dict[str, int], caps: dict[str, int],
                 worth_probing: Callable[[Request], bool]) -> str | None:
        """Count rounds off per request; of those past their interval, the one off longest that
        is worth probing drafts `probe_k` tokens (set in `ks`). Returns its slot, if any."""
        due = []
        for s in candidates:
            slot = s.slot_id
            if ks[slot] > 0:
                if slot not in self._probing:  # chosen on its merits: speculation pays again
                    self._interval.pop(slot, None)
                self._idle[slot] = 0
                continue
            if slot in self._probing:  # the last probe did not turn it back on: back off
                self._interval[slot] = min(2 * self._interval.get(slot, self.every), self.max_every)
            idle = self._idle[slot] = self._idle.get(slot, 0) + 1
            if idle >= self._interval.get(slot, self.every):
                due.append((idle, s))
        self._probing = set()
        for _, s in sorted(due, key=lambda pair: pair[0], reverse=True):
            if worth_probing(s):
                ks[s.slot_id] = min(self.probe_k, caps[s.slot_id])
                self._idle[s.slot_id] = 0
                self._probing.add(s.slot_id)
                return s.slot_id
            self._idle[s.slot_id] = max(0, self._interval.get(s.slot_id, self.every) - len(candidates))
        return None

    def forget(self, slot_id: str) -> None:
        self._idle.pop(slot_id, None)
        self._interval.pop(slot_id, None)
        self._probing.discard(slot_id)
