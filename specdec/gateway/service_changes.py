"""What the gateway re-reads when a model service comes back changed.

A service that restarts (a crash, a rollout, a move to another machine) may come back
with other start-up costs, another KV pool, or, by operator error, another model. The
monitor hands every Info that differs from the last one it kept to `ServiceChanges`, which
either adopts it or refuses the service:

- **adopted**: the K planner takes the new cost table and forgets the old one's online
  correction, the deadlines follow the new costs, admission counts the new pool, and the
  KV handoff from target to draft follows the two services' layouts;
- **refused**: a tokenizer that differs from the gateway's, or a maximum K or context
  length below what the gateway promised at start-up. A refused draft only turns
  speculation off; a refused target makes the gateway NOT_SERVING. Both are logged with
  the reason, and the service is taken back as soon as a later Info passes.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from specdec.cost_model import CostTable
from specdec.gateway.kv_handoff import KVHandoff
from specdec.gateway.pools import PoolLimits
from specdec.gateway.scheduler import Scheduler
from specdec.model.tokenizer_info import TokenizerInfo, TokenizerMismatchError, check_compatible
from specdec.wire.model_info import ModelInfo

log = logging.getLogger(__name__)


@dataclass
class ServiceChanges:
    scheduler: Scheduler
    #: The tokenizer the gateway encodes with (the target's at start-up).
    tokenizer: TokenizerInfo
    #: Limits the gateway validates requests against: a service must still allow them.
    max_speculative_tokens: int
    max_seq_len: int
    #: Whether the planner uses the draft's costs (adaptive K on).
    adaptive_k: bool
    #: Whether the gateway may fill the draft's cache from the target's (--kv-handoff).
    kv_handoff: bool = False
    #: The latest adopted Info of each service (at first, the ones the gateway started with).
    adopted: dict[str, ModelInfo] = field(default_factory=dict)

    def __call__(self, name: str, info: ModelInfo) -> str | None:
        """Adopt `info` of service `name` ("target" or "draft"), or return why it is refused."""
        reason = self._refusal(name, info)
        if name == "draft":
            self.scheduler.draft_refused = reason is not None
        if reason is not None:
            return reason
        costs = list(info.forward_costs)
        planner_costs = costs if name == "target" or self.adaptive_k else []
        before = self.adopted.get(name)
        self.adopted[name] = info
        same_model = before is not None and model_identity(before) == model_identity(info)
        self.scheduler.planner.set_costs(name, planner_costs, same_model=same_model)
        table = CostTable(costs) if costs else None
        deadlines = self.scheduler.deadlines
        self.scheduler.deadlines = (
            dataclasses.replace(deadlines, target=table) if name == "target"
            else dataclasses.replace(deadlines, draft=table)
        )
        self.scheduler.set_pool(PoolLimits(name, info.total_kv_tokens, info.block_size, info.max_slots))
        if self.kv_handoff:
            self.scheduler.planner.kv_handoff = KVHandoff.between(self.adopted["target"], self.adopted.get("draft"))
        log.info(
            "adopted the %s service's new Info: %s, %d KV tokens, %d slots, %s",
            name, info.model_name, info.total_kv_tokens, info.max_slots,
            f"{len(costs)} measured forward costs" if costs else "no measured costs",
        )
        return None

    def _refusal(self, name: str, info: ModelInfo) -> str | None:
        try:
            check_compatible(info.tokenizer, self.tokenizer, (name, "gateway"))
        except TokenizerMismatchError as error:
            return f"{error}; restart the gateway to serve another model"
        if info.max_speculative_tokens < self.max_speculative_tokens:  # the target verifies K + 1 tokens
            return (f"it allows K up to {info.max_speculative_tokens}, "
                    f"the gateway promises {self.max_speculative_tokens}")
        if info.max_seq_len < self.max_seq_len:
            return f"its context holds {info.max_seq_len} tokens, the gateway promises {self.max_seq_len}"
        return None


def model_identity(info: ModelInfo) -> tuple[object, ...]:
    """What a service computes with: another model, quantization or layer count drafts
    otherwise; a new cost table alone (a restart, costs timed again) does not."""
    return info.model_id, info.quantization, info.kv_layout
