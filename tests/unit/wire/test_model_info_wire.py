"""ModelInfo survives its trip through protobuf, the compiled steps and costs included."""

from __future__ import annotations

from specdec.cost_model import ForwardCost
from specdec.model.tokenizer_info import TokenizerInfo
from specdec.v1 import common_pb2
from specdec.wire.model_info import ModelInfo


def test_model_info_round_trips_through_protobuf() -> None:
    info = ModelInfo(
        model_id="smollm2-135m", model_name="smollm2-135m", tokenizer=TokenizerInfo(49152, (0, 2), "abc"),
        max_seq_len=8192, block_size=16, free_kv_tokens=1000, total_kv_tokens=2048, max_slots=8, active_slots=1,
        max_speculative_tokens=16, dtype="bfloat16", device="cpu", quantization="int4",
        forward_costs=(ForwardCost(1, 1, 0.01, context=48), ForwardCost(4, 9, 0.1, context=304)),
        compiled_steps=("single-request 1-token steps", "batch 1-token steps"), pending_graphs=2,
    )
    wire = common_pb2.ModelInfo.FromString(info.to_pb().SerializeToString())
    assert ModelInfo.from_pb(wire) == info
    assert list(wire.compiled_steps) == ["single-request 1-token steps", "batch 1-token steps"]
    assert wire.pending_graphs == 2
