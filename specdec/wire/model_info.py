"""What a model service says of itself through its Info rpc (`ModelInfo`), what its keys
and values are computed from (`KVLayout`), and the room in its pool after each call
(`PoolRoom`), with `to_pb` / `from_pb` as in `specdec.wire.items`."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.cost_model import ForwardCost
from specdec.model.tokenizer_info import TokenizerInfo
from specdec.tuning.choices import TuningChoice
from specdec.v1 import common_pb2, draft_pb2, target_pb2


@dataclass(frozen=True)
class KVLayout:
    """What a service's keys and values are computed from (`common.proto` KVLayout): two
    services with the same `weights` compute the same keys and values in their shared layers."""

    weights: str = ""
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0

    def feeds(self, other: KVLayout) -> bool:
        """Whether this service's cache can fill `other`'s: the same weights and head shape,
        and every layer of `other` among this one's."""
        return (bool(self.weights) and self.weights == other.weights and self.num_kv_heads == other.num_kv_heads
                and self.head_dim == other.head_dim and 0 < other.num_layers <= self.num_layers)

    def to_pb(self) -> common_pb2.KVLayout:
        return common_pb2.KVLayout(weights=self.weights, num_layers=self.num_layers,
                                   num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)

    @classmethod
    def from_pb(cls, message: common_pb2.KVLayout) -> KVLayout:
        return cls(message.weights, message.num_layers, message.num_kv_heads, message.head_dim)


@dataclass(frozen=True)
class PoolRoom:
    """A service's KV blocks and slots after a Prefill, Verify or Propose (`common.proto`
    PoolRoom): those free, those the caller's lease holder holds, and the free blocks other
    holders' slots have reserved to grow into."""

    free_blocks: int
    free_slots: int
    held_blocks: int
    held_slots: int
    reserved_blocks: int = 0

    def to_pb(self) -> common_pb2.PoolRoom:
        return common_pb2.PoolRoom(free_blocks=self.free_blocks, free_slots=self.free_slots,
                                   held_blocks=self.held_blocks, held_slots=self.held_slots,
                                   reserved_blocks=self.reserved_blocks)

    @classmethod
    def of(cls, response: target_pb2.PrefillResponse | target_pb2.VerifyResponse | draft_pb2.ProposeResponse,
           ) -> PoolRoom | None:
        """The room a response reports; None from a service before the field."""
        if not response.HasField("room"):
            return None
        room = response.room
        return cls(room.free_blocks, room.free_slots, room.held_blocks, room.held_slots, room.reserved_blocks)


@dataclass(frozen=True)
class ModelInfo:
    """What a model service advertises through its Info rpc."""

    #: The source the model was loaded from (embedded name, .gguf path, directory or hub
    #: id): what the gateway loads the same tokenizer from.
    model_id: str
    #: For people and dashboards; may describe changes (e.g. "(first 2 layers)").
    model_name: str
    tokenizer: TokenizerInfo
    max_seq_len: int
    block_size: int
    free_kv_tokens: int
    total_kv_tokens: int
    max_slots: int
    active_slots: int
    max_speculative_tokens: int
    dtype: str
    device: str
    quantization: str
    forward_costs: tuple[ForwardCost, ...] = ()
    #: The forward steps that run compiled, e.g. "single-request 1-token steps".
    compiled_steps: tuple[str, ...] = ()
    #: Every start-up choice and why (`specdec.tuning.choices`).
    tuning: tuple[TuningChoice, ...] = ()
    #: Compiled graphs still to load after start-up (those steps run eager until then).
    pending_graphs: int = 0
    kv_layout: KVLayout = KVLayout()

    def to_pb(self) -> common_pb2.ModelInfo:
        return common_pb2.ModelInfo(
            model_id=self.model_id,
            model_name=self.model_name,
            vocab_size=self.tokenizer.vocab_size,
            eos_token_ids=list(self.tokenizer.eos_token_ids),
            tokenizer_fingerprint=self.tokenizer.fingerprint,
            max_seq_len=self.max_seq_len,
            block_size=self.block_size,
            free_kv_tokens=self.free_kv_tokens,
            total_kv_tokens=self.total_kv_tokens,
            max_slots=self.max_slots,
            active_slots=self.active_slots,
            max_speculative_tokens=self.max_speculative_tokens,
            dtype=self.dtype,
            device=self.device,
            quantization=self.quantization,
            forward_costs=[
                common_pb2.ForwardCost(batch_size=c.batch_size, tokens=c.tokens, seconds=c.seconds,
                                       context_tokens=c.context)
                for c in self.forward_costs
            ],
            compiled_steps=list(self.compiled_steps),
            tuning=[
                common_pb2.TuningChoice(name=c.name, value=c.value, reason=c.reason, detail=c.detail)
                for c in self.tuning
            ],
            pending_graphs=self.pending_graphs,
            kv_layout=self.kv_layout.to_pb(),
        )

    @classmethod
    def from_pb(cls, message: common_pb2.ModelInfo) -> ModelInfo:
        return cls(
            model_id=message.model_id,
            model_name=message.model_name,
            tokenizer=TokenizerInfo(message.vocab_size, tuple(sorted(message.eos_token_ids)),
                                    message.tokenizer_fingerprint),
            max_seq_len=message.max_seq_len,
            block_size=message.block_size,
            free_kv_tokens=message.free_kv_tokens,
            total_kv_tokens=message.total_kv_tokens,
            max_slots=message.max_slots,
            active_slots=message.active_slots,
            max_speculative_tokens=message.max_speculative_tokens,
            dtype=message.dtype,
            device=message.device,
            quantization=message.quantization,
            forward_costs=tuple(ForwardCost.from_pb(c) for c in message.forward_costs),
            compiled_steps=tuple(message.compiled_steps),
            tuning=tuple(TuningChoice(c.name, c.value, c.reason, c.detail) for c in message.tuning),
            pending_graphs=message.pending_graphs,
            kv_layout=KVLayout.from_pb(message.kv_layout),
        )
