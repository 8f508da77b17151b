"""The target's keys and values into the draft's cache over real loopback servers
(`TargetService.ExportKV`, `DraftService.ImportKV`).

Target and draft here are the same fp32 model, so the keys and values the target computed
for a prompt are the ones the draft would compute (up to the rounding of a wider forward):
an imported slot must hold the target's rows and draft the same tokens as one the draft
filled itself.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch

from specdec.model.loader import LoadedModel
from specdec.v1 import common_pb2, draft_pb2, target_pb2
from specdec.wire.kv_transfer import ImportHeader, KVExport, assemble_pieces, split_pieces
from specdec.wire.tensor_codec import encode_tensor
from tests.draft_server.test_draft_service import item, propose, sampled
from tests.support.services import Service, rpc_error
from tests.target_server.test_target_service import prefill


def export(target: Service, slot: str, start: int, end: int, layers: int = 0) -> list[common_pb2.KVPiece]:
    request = KVExport(slot, start, end, layers or len(target.engine.cache.kv), torch.float32).to_pb()
    return list(target.stub.ExportKV(request, timeout=60))


def import_kv(draft: Service, header: ImportHeader, pieces: list[common_pb2.KVPiece]) -> int:
    messages = [header.to_pb(), *(draft_pb2.ImportKVRequest(piece=p) for p in pieces)]
    return int(draft.stub.ImportKV(iter(messages), timeout=60).cached_len)


def cache_rows(service: Service, slot: str) -> torch.Tensor:
    """The slot's keys and values in every layer: [layers, tokens, 2, kv_heads, head_dim]."""
    engine = service.engine
    rows = torch.tensor(engine.cache.blocks.positions(slot))
    return torch.stack([pool.index_select(0, rows) for pool in engine.cache.kv])


def test_both_services_advertise_the_same_layout(target: Service, draft: Service, target_model: LoadedModel) -> None:
    layouts = [service.info().kv_layout for service in (target, draft)]
    assert layouts[0] == layouts[1]
    assert layouts[0].weights and layouts[0].num_layers == target_model.model.config.num_hidden_layers
    assert (layouts[0].num_kv_heads, layouts[0].head_dim) == (3, 64)


def test_an_imported_prompt_drafts_as_one_the_draft_computed(
    target: Service, draft: Service, prompts: list[list[int]]
) -> None:
    prompt = prompts[2]
    prefill(target, {"t": prompt})
    pieces = export(target, "t", 0, len(prompt) - 1)
    assert import_kv(draft, ImportHeader("imported", 0, prompt[:-1]), pieces) == len(prompt) - 1
    assert torch.equal(cache_rows(draft, "imported"), cache_rows(target, "t")[:, : len(prompt) - 1])
    propose(draft, item("own", prompt[:-1], k=1))  # the draft's own prefill of the same tokens
    # The same model and dtype: the same keys and values, up to a wider prefill's rounding.
    torch.testing.assert_close(cache_rows(draft, "imported"), cache_rows(draft, "own")[:, : len(prompt) - 1])
    imported = propose(draft, item("imported", prompt[-1:], k=6, valid_len=len(prompt) - 1))["imported"]
    own = propose(draft, item("own", prompt[-1:], k=6, valid_len=len(prompt) - 1))["own"]
    assert list(imported.tokens) == list(own.tokens)


def test_an_import_after_the_slots_valid_prefix_rolls_back_first(
    target: Service, draft: Service, prompts: list[list[int]]
) -> None:
    """A draft that fell behind (a lookup drafted meanwhile) takes the rest from the target;
    its own rejected tokens past valid_len are dropped first."""
    prompt = prompts[2]
    prefill(target, {"t": prompt})
    propose(draft, item("d", prompt[:5], k=4))  # caches 5 + 3 drafted tokens
    pieces = export(target, "t", 5, len(prompt) - 1)
    assert import_kv(draft, ImportHeader("d", 5, prompt[5:-1]), pieces) == len(prompt) - 1
    assert draft.engine.tokens["d"] == prompt[:-1]
    assert torch.equal(cache_rows(draft, "d")[:, 5:], cache_rows(target, "t")[:, 5 : len(prompt) - 1])


def test_an_imported_slot_draws_unseeded_tokens_with_its_own_generator(
    target: Service, draft: Service, prompts: list[list[int]]
) -> None:
    """A slot the import created gets its random stream at its first Propose, as a slot the
    Propose created does: its draws do not depend on what else is batched with it."""
    prompt = prompts[1]
    prefill(target, {"t": prompt})
    import_kv(draft, ImportHeader("s", 0, prompt[:-1]), export(target, "t", 0, len(prompt) - 1))
    request = item("s", prompt[-1:], k=3, valid_len=len(prompt) - 1, sampling=sampled(seed=None))
    propose(draft, request)
    assert "s" in draft.engine.generators


def test_pieces_split_and_come_back_whole() -> None:
    kv = torch.randn(3, 50, 2, 3, 64)
    pieces = list(split_pieces(kv, piece_bytes=20 * 2 * 3 * 64 * 4))  # 20 positions a piece
    assert [(p.layer, p.start) for p in pieces][:4] == [(0, 0), (0, 20), (0, 40), (1, 0)]
    assert torch.equal(assemble_pieces(pieces, (3, 50, 2, 3, 64), torch.float32), kv)


def _bad_imports(prompt: list[int], pieces: list[common_pb2.KVPiece]) -> Iterator[tuple[str, list[object], str]]:
    """(case, messages, words of the error) for imports the draft must refuse whole."""
    header = ImportHeader("new", 0, prompt)
    yield "no header", [draft_pb2.ImportKVRequest(piece=pieces[0])], "header"
    yield "a missing piece", [header.to_pb(), *(draft_pb2.ImportKVRequest(piece=p) for p in pieces[1:])], \
        "were not sent"
    repeated = [pieces[0], pieces[0], *pieces[2:]]  # layer 0 twice, layer 1 never
    yield "a repeated piece", [header.to_pb(), *(draft_pb2.ImportKVRequest(piece=p) for p in repeated)], "repeats"
    yield "valid_len of a new slot", [ImportHeader("new", 3, prompt).to_pb()], "valid_len"
    yield "a token outside the vocabulary", [ImportHeader("new", 0, [*prompt[:-1], 10**6]).to_pb()], "vocabulary"
    keys_only = common_pb2.KVPiece(layer=0, start=0, kv=encode_tensor(torch.zeros(len(prompt), 1, 3, 64)))
    yield "rows of another shape", [header.to_pb(), draft_pb2.ImportKVRequest(piece=keys_only)], "rows of shape"
    yield "more bytes than the tokens need", [ImportHeader("new", 0, prompt[:1]).to_pb(),
                                              *(draft_pb2.ImportKVRequest(piece=p) for p in pieces)], "more bytes"
    yield "a piece past the end", [header.to_pb(), draft_pb2.ImportKVRequest(
        piece=common_pb2.KVPiece(layer=30, start=0, kv=pieces[0].kv))], "outside"


def test_a_bad_import_is_refused_and_changes_nothing(
    target: Service, draft: Service, prompts: list[list[int]]
) -> None:
    prompt = prompts[1]
    prefill(target, {"t": prompt})
    pieces = export(target, "t", 0, len(prompt))
    for case, messages, words in _bad_imports(prompt, pieces):
        error = rpc_error(lambda m: draft.stub.ImportKV(iter(m), timeout=60), messages)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, case
        assert words in error.details(), (case, error.details())
        assert not draft.engine.tokens and draft.engine.cache.blocks.free_tokens == draft.engine.cache.capacity_tokens


@pytest.mark.parametrize(("start", "end", "layers", "code"), [
    (0, 99, 30, grpc.StatusCode.INVALID_ARGUMENT),  # past the slot's cached length
    (4, 2, 30, grpc.StatusCode.INVALID_ARGUMENT),
    (0, 2, 31, grpc.StatusCode.INVALID_ARGUMENT),  # more layers than the model has
])
def test_a_bad_export_is_refused(
    target: Service, prompts: list[list[int]], start: int, end: int, layers: int, code: grpc.StatusCode
) -> None:
    prefill(target, {"t": prompts[0]})
    error = rpc_error(lambda r: list(target.stub.ExportKV(r, timeout=60)),
                      target_pb2.ExportKVRequest(slot_id="t", start=start, end=end, num_layers=layers))
    assert error.code() == code


def test_an_export_of_an_unknown_slot_is_not_found(target: Service) -> None:
    error = rpc_error(lambda r: list(target.stub.ExportKV(r, timeout=60)),
                      target_pb2.ExportKVRequest(slot_id="nobody", start=0, end=1, num_layers=1))
    assert error.code() == grpc.StatusCode.NOT_FOUND
