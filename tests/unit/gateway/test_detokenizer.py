"""Incremental detokenization: EOS, stop strings across token boundaries, held-back text."""

from __future__ import annotations

import pytest

from specdec.gateway.detokenizer import StopStringDetokenizer
from specdec.model.choices import DEFAULT_MODEL
from specdec.model.loader import load_tokenizer

EOS = 2


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    """The embedded model's tokenizer alone (no weights are loaded)."""
    return load_tokenizer(DEFAULT_MODEL)


def _ids(tokenizer, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return list(tokenizer(text)["input_ids"])


def test_plain_text_streams_in_full(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = _ids(tokenizer, "Hello there, general Kenobi.")
    detok = StopStringDetokenizer(tokenizer, [], {EOS})
    pieces = [detok.add(ids[:3]), detok.add(ids[3:])]
    assert [p.tokens for p in pieces] == [ids[:3], ids[3:]]
    assert "".join(p.text for p in pieces) == "Hello there, general Kenobi."
    assert not any(p.stopped for p in pieces)


def test_eos_in_the_middle_of_a_round_drops_what_follows(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = _ids(tokenizer, "One two")
    update = StopStringDetokenizer(tokenizer, [], {EOS}).add([*ids, EOS, *_ids(tokenizer, " three")])
    assert update.stopped and update.tokens == ids and update.text == "One two"


def test_stop_string_completed_mid_round_keeps_tokens_up_to_it(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "The quick brown fox jumps over the lazy dog"
    ids = _ids(tokenizer, text)
    pieces = [tokenizer.decode([t]) for t in ids]
    # A stop string spanning the boundary between two tokens in the middle of one round.
    i = next(i for i in range(1, len(pieces) - 2) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    detok = StopStringDetokenizer(tokenizer, [stop], {EOS})
    update = detok.add(ids)
    assert update.stopped
    assert update.tokens == ids[: i + 2]
    assert update.text == text[: text.index(stop)]


def test_a_possible_stop_prefix_is_held_back_then_released(tokenizer) -> None:  # type: ignore[no-untyped-def]
    detok = StopStringDetokenizer(tokenizer, ["lazy cat"], {EOS})
    first = detok.add(_ids(tokenizer, "the lazy"))
    assert first.text == "the "  # "lazy" may start the stop string
    second = detok.add(_ids(tokenizer, " dog"))
    assert not second.stopped and first.text + second.text == "the lazy dog"


def test_incomplete_utf8_character_is_held_back(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = _ids(tokenizer, "café ☕")
    detok = StopStringDetokenizer(tokenizer, [], {EOS})
    texts = [detok.add([t]).text for t in ids]
    assert all("\ufffd" not in t for t in texts)
    assert "".join(texts) + detok.finish() == "café ☕"
