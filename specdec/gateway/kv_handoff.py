"""Filling the draft's cache from the target's instead of feeding it the tokens.

A self-draft (the target's own weights quantized, or their first layers; `KVLayout.feeds`)
computes nearly the keys and values the target already holds for every token it verified.
Where the draft has fallen behind by more than a round's tokens (a prompt it never saw,
tokens decoded while speculation was off or drafted by lookup), the gateway moves the
target's keys and values over (`TargetAPI.export_kv`, then `DraftAPI.import_kv`)
rather than have the draft recompute them: a copy, against a forward over the whole
prompt, where the planner measures it cheaper (`HandoffCost`). What the draft proposes
afterwards is still only a proposal, judged by the target as always, so the output is
unchanged; only the draft's acceptance could move, and it did not measurably
(docs/performance.md#the-draft-cache-from-the-target).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import grpc
import torch

from specdec.errors import ServiceStateError
from specdec.gateway.deadlines import Deadlines
from specdec.gateway.model_clients import DraftAPI, TargetAPI
from specdec.gateway.request import Request
from specdec.model.choices import DTYPE_NAMES
from specdec.wire.kv_transfer import ImportHeader, KVExport
from specdec.wire.model_info import ModelInfo

log = logging.getLogger(__name__)

#: What a handoff is priced at before any was measured: a call's fixed part and a part per
#: token, about what loopback handoffs of the default models measure on a 2-core CPU
#: (docs/performance.md#the-draft-cache-from-the-target).
PRIOR_CALL_S = 0.02
PRIOR_TOKEN_S = 1.4e-4
#: The least relative spread of the measured handoffs' sizes (variance ÷ mean square) that
#: fits the part per token; below it, only the fixed part follows the measurements.
MIN_SIZE_SPREAD = 0.05


@dataclass(frozen=True)
class KVHandoff:
    """How the target's cache fills the draft's: the draft's layers, in its cache's dtype."""

    num_layers: int
    dtype: torch.dtype

    @classmethod
    def between(cls, target: ModelInfo, draft: ModelInfo | None) -> KVHandoff | None:
        """The handoff from `target` to `draft` where the target's keys and values are the
        draft's to take (`KVLayout.feeds`) and its dtype travels; else None."""
        if draft is None or not target.kv_layout.feeds(draft.kv_layout) or draft.dtype not in DTYPE_NAMES:
            return None
        return cls(draft.kv_layout.num_layers, getattr(torch, draft.dtype))


@dataclass
class HandoffCost:
    """Seconds of one request's handoff: a fixed part (two calls and a hop to each service's
    model worker) and a part per token, fit to the handoffs measured by exponentially
    weighted least squares, so that the price follows this machine and its load."""

    call_s: float = PRIOR_CALL_S
    token_s: float = PRIOR_TOKEN_S
    #: Weight of the newest measurement.
    weight: float = 0.1
    #: The decayed sums of 1, tokens, seconds, tokens² and tokens × seconds.
    _sums: tuple[float, float, float, float, float] = field(default=(0.0, 0.0, 0.0, 0.0, 0.0), init=False)

    def seconds(self, tokens: int) -> float:
        return self.call_s + self.token_s * tokens

    def observe(self, tokens: int, seconds: float) -> None:
        decay = 1.0 - self.weight
        w, n, t, nn, nt = (total * decay for total in self._sums)
        w, n, t, nn, nt = w + 1.0, n + tokens, t + seconds, nn + tokens * tokens, nt + tokens * seconds
        self._sums = (w, n, t, nn, nt)
        spread = w * nn - n * n
        if spread > MIN_SIZE_SPREAD * w * nn:
            self.token_s = max(0.0, (w * nt - n * t) / spread)
        self.call_s = max(0.0, (t - self.token_s * n) / w)


async def hand_off(
    target: TargetAPI, draft: DraftAPI, seqs: list[Request], handoff: KVHandoff, deadlines: Deadlines
) -> dict[str, tuple[int, float]]:
    """Fill the draft's cache of each of `seqs` with the target's keys and values up to what
    the target holds; returns the tokens moved and the seconds it took, per request that took
    one. A request whose handoff fails keeps its place (its Propose then feeds the tokens as
    before): the handoff only ever saves time."""
    done = {}
    for seq in seqs:
        start, end = seq.draft_valid, seq.target_valid
        if end <= start:
            continue
        header = ImportHeader(seq.slot_id, start, seq.tokens[start:end], max_len=seq.declared_len)
        export = KVExport(seq.slot_id, start, end, handoff.num_layers, handoff.dtype)
        timeout = deadlines.propose(1, end - start, 0)  # never longer than the draft computing them
        seq.has_draft_slot = True  # the import may create the slot: release it at the end
        started = time.perf_counter()
        try:
            imported = await draft.import_kv(header, await target.export_kv(export, timeout), timeout)
            if imported.value != end:
                raise ServiceStateError(f"the draft holds {imported.value} tokens for slot {seq.slot_id} after "
                                        f"the import, the gateway expected {end}")
        except grpc.aio.AioRpcError as error:  # the draft holds what it held: an import is all or nothing
            log.warning("KV handoff of %s failed (%s: %s); its draft catches up by itself", seq.slot_id,
                        error.code().name, error.details())
            continue
        except ServiceStateError as error:
            log.warning("%s; its next Propose resends every token", error)
            seq.draft_valid = 0
            continue
        seq.draft_valid = end
        done[seq.slot_id] = (end - start, time.perf_counter() - started)
    return done
