"""The tuning cache: the same key reuses, a changed field measures again, a bad file is ignored."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from specdec.tuning.store import TuningKey, TuningStore, code_version, machine_fingerprint

KEY = TuningKey(
    machine="Some CPU [abc]", torch="2.13.0", model="smollm2-135m", weights="0123", dtype="bfloat16",
    quantization="int4", device="cpu", threads=2, code="feed", settings="compile=auto",
)
CHOICES = {"int4_kernel": "int4dot", "compiled_steps": {"1x1": True}, "forward_costs": [[1, 1, 0.01, 48]]}


def test_the_same_key_reuses_what_was_saved(tmp_path: Path) -> None:
    store = TuningStore(tmp_path)
    assert store.load(KEY) == {}  # nothing yet: measure
    store.save(KEY, CHOICES)
    assert TuningStore(tmp_path).load(dataclasses.replace(KEY)) == CHOICES
    assert [p.name for p in tmp_path.iterdir()] == [f"{KEY.digest()}.json"]  # no partial file left behind


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(TuningKey)])
def test_a_changed_field_measures_again(tmp_path: Path, field: str) -> None:
    store = TuningStore(tmp_path)
    store.save(KEY, CHOICES)
    changed = dataclasses.replace(KEY, **{field: 3 if field == "threads" else "other"})
    assert changed.digest() != KEY.digest()
    assert store.load(changed) == {}


@pytest.mark.parametrize("text", ["{not json", "[]", '{"format": 1}', '{"format": 99, "key": {}, "choices": {}}'])
def test_a_corrupt_file_is_ignored_with_a_warning(tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture) -> None:
    store = TuningStore(tmp_path)
    store.path(KEY).write_text(text)
    with caplog.at_level(logging.WARNING):
        assert store.load(KEY) == {}
    assert "ignored" in caplog.text
    store.save(KEY, CHOICES)  # the next measurement replaces it
    assert store.load(KEY) == CHOICES


def test_a_file_written_for_another_key_is_not_trusted(tmp_path: Path) -> None:
    store = TuningStore(tmp_path)
    other = dataclasses.replace(KEY, model="another")
    store.save(other, CHOICES)
    store.path(other).rename(store.path(KEY))  # e.g. copied by hand
    assert store.load(KEY) == {}
    data = json.loads(store.path(KEY).read_text())
    assert data["key"]["model"] == "another"


def test_the_code_version_follows_the_sources(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    source = tmp_path / "model" / "llama.py"
    source.write_text("x = 1\n")
    before = code_version(tmp_path)
    assert code_version(tmp_path) == before
    source.write_text("x = 2\n")
    assert code_version(tmp_path) != before
    assert len(code_version()) == 16


def test_the_machine_names_its_cpu() -> None:
    name = machine_fingerprint("cpu")
    assert name and name.endswith("]")
