"""Incremental detokenization and stop strings, on SmolLM2's byte-level tokenizer."""

from __future__ import annotations

import pytest

from engine.detokenize import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer


def stream(tok, text: str, **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    """Push `text`'s tokens one at a time; return the deltas (flush last) and the detokenizer."""
    detok = IncrementalDetokenizer(tok.token_bytes, tok.special_ids, **kwargs)
    deltas = []
    for token in tok.encode(text, add_special_tokens=False):
        delta = detok.push([token])
        deltas.append(delta.text)
        if delta.stop is not None:
            break
    deltas.append(detok.flush())
    return deltas, detok


def test_emoji_split_over_tokens_is_emitted_whole(tok):
    text = "Party 🎉🎊 time"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # the emoji really are split into byte tokens
    deltas, _ = stream(tok, text)
    assert "".join(deltas) == text
    for d in deltas:  # every delta is whole characters: no replacement chars, no lone surrogates
        assert "\ufffd" not in d
        d.encode("utf-8")
    assert "🎉" in deltas  # completed by the token that finished its bytes


def test_cjk_and_accents(tok):
    text = "東京は日本の首都です。naïve café"
    deltas, _ = stream(tok, text)
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)


def test_stop_string_spanning_three_tokens(tok):
    text = "Hello world, STOP here and more"
    ids = tok.encode(text, add_special_tokens=False)
    assert [tok.token_bytes[i] for i in ids[2:5]] == [b",", b" ST", b"OP"]
    deltas, detok = stream(tok, text, stop=[", STOP"])
    assert "".join(deltas) == "Hello world"
    assert detok.stopped == ", STOP"
    _, with_stop = stream(tok, text, stop=[", STOP"], include_stop_str_in_output=True)
    assert with_stop.text == "Hello world, STOP"


def test_partial_stop_is_held_back_then_released(tok):
    detok = IncrementalDetokenizer(tok.token_bytes, tok.special_ids, stop=[" world peace"])
    ids = tok.encode("Hello world", add_special_tokens=False)
    first = detok.push(ids[:1])
    second = detok.push(ids[1:])
    assert first.text == "Hello" and second.text == ""  # " world" might begin the stop string
    assert detok.flush() == " world"  # generation ended without it: released


def test_earliest_of_several_stops_wins(tok):
    deltas, detok = stream(tok, "one two three four", stop=["four", "two"])
    assert "".join(deltas) == "one " and detok.stopped == "two"


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("<|im_start|>assistant\nHi<|im_end|>", add_special_tokens=False)
    skip = IncrementalDetokenizer(tok.token_bytes, tok.special_ids)
    keep = IncrementalDetokenizer(tok.token_bytes, tok.special_ids, skip_special_tokens=False)
    assert skip.push(ids).text + skip.flush() == "assistant\nHi"
    assert keep.push(ids).text + keep.flush() == "<|im_start|>assistant\nHi<|im_end|>"


def test_incomplete_character_at_the_end_becomes_a_replacement(tok):
    ids = tok.encode("🎉", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok.token_bytes, tok.special_ids)
    assert detok.push(ids[:-1]).text == ""
    assert detok.flush() == "\ufffd"
