"""Protobuf <-> domain conversions shared by the services."""

from __future__ import annotations

from specdec.cost_model import ForwardCost
from specdec.sampling.params import SamplingParams
from specdec.serving.engine import EngineInfo
from specdec.v1 import common_pb2, draft_pb2, target_pb2
from specdec.wire.items import PrefillItem, ProposeItem, VerifyItem


def engine_info_to_pb(info: EngineInfo) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        model_name=info.model_name,
        vocab_size=info.tokenizer.vocab_size,
        eos_token_ids=list(info.tokenizer.eos_token_ids),
        tokenizer_fingerprint=info.tokenizer.fingerprint,
        max_seq_len=info.max_seq_len,
        block_size=info.block_size,
        free_kv_tokens=info.free_kv_tokens,
        total_kv_tokens=info.total_kv_tokens,
        max_slots=info.max_slots,
        active_slots=info.active_slots,
        max_speculative_tokens=info.max_speculative_tokens,
        dtype=info.dtype,
        device=info.device,
        quantization=info.quantization,
        forward_costs=[
            common_pb2.ForwardCost(batch_size=c.batch_size, tokens=c.tokens, seconds=c.seconds)
            for c in info.forward_costs
        ],
    )


def forward_costs_from_pb(info: common_pb2.ModelInfo) -> list[ForwardCost]:
    return [ForwardCost(c.batch_size, c.tokens, c.seconds) for c in info.forward_costs]


def sampling_from_pb(message: common_pb2.SamplingParams) -> SamplingParams:
    """Proto defaults (0) mean "off" for top_p and repetition_penalty; validation names the field."""
    return SamplingParams(
        temperature=message.temperature,
        top_k=message.top_k,
        top_p=message.top_p or 1.0,
        repetition_penalty=message.repetition_penalty or 1.0,
        seed=message.seed if message.HasField("seed") else None,
    )


def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        repetition_penalty=params.repetition_penalty,
    )
    if params.seed is not None:
        message.seed = params.seed
    return message


def prefill_item_from_pb(item: target_pb2.PrefillItem) -> PrefillItem:
    return PrefillItem(item.slot_id, list(item.prompt_tokens))


def prefill_item_to_pb(item: PrefillItem) -> target_pb2.PrefillItem:
    return target_pb2.PrefillItem(slot_id=item.slot_id, prompt_tokens=item.prompt_tokens)


def verify_item_from_pb(item: target_pb2.VerifyItem) -> VerifyItem:
    return VerifyItem(item.slot_id, item.valid_len, list(item.tokens))


def verify_item_to_pb(item: VerifyItem) -> target_pb2.VerifyItem:
    return target_pb2.VerifyItem(slot_id=item.slot_id, valid_len=item.valid_len, tokens=item.tokens)


def propose_item_from_pb(item: draft_pb2.ProposeItem) -> ProposeItem:
    return ProposeItem(item.slot_id, item.valid_len, list(item.new_tokens), item.num_speculative_tokens, sampling_from_pb(item.sampling))


def propose_item_to_pb(item: ProposeItem) -> draft_pb2.ProposeItem:
    return draft_pb2.ProposeItem(
        slot_id=item.slot_id, valid_len=item.valid_len, new_tokens=item.new_tokens, num_speculative_tokens=item.num_speculative_tokens,
        sampling=sampling_to_pb(item.sampling),
    )
