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


def test_bytes_decode_as_codecs_incremental_decoder_does():
    """Random byte tokens (whole, split and invalid UTF-8; one and several a push, special ids
    among them) give, delta by delta and after the flush, the text of codecs' incremental
    UTF-8 decoder with errors="replace" over the same bytes."""
    import codecs
    import random

    rng = random.Random(7)
    pieces = ["a", "é", "東", "🎉", " the", "\u0301"]
    table = [p.encode() for p in pieces] + [b"\xf0\x9f", b"\x8e\x89", b"\xe6", b"\x9d\xb1", b"\xff", b"\xc3",
                                            b"\x80\x80", b"<s>"]
    special = frozenset({len(table) - 1})
    for trial in range(200):
        ids = [rng.randrange(len(table)) for _ in range(rng.randrange(1, 24))]
        detok = IncrementalDetokenizer(table, special)
        reference = codecs.getincrementaldecoder("utf-8")(errors="replace")
        i = 0
        while i < len(ids):
            chunk = ids[i:i + rng.choice((1, 1, 1, 2, 3))]
            i += len(chunk)
            got = detok.push(chunk).text
            want = reference.decode(b"".join(table[t] for t in chunk if t not in special))
            assert got == want, (trial, ids)
        assert detok.flush() == reference.decode(b"", final=True), (trial, ids)


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_against_a_search_of_the_whole_text(include):
    """Random pushes over a small alphabet (stop strings occur often, overlap, share prefixes,
    arrive split over tokens and inside multi-byte characters): after every push the text
    returned so far, joined, is the whole text decoded so far cut where the first stop string
    to appear begins (or ends, with include_stop_str_in_output) - nothing of a stop string is
    ever returned first and taken back - and the rest comes out at flush. Until a stop string
    appears, only the longest end of the text that begins one is held back. Strings that
    overlap themselves ("abab", "aabaa", "ababababx") take the matcher back along its borders."""
    import codecs
    import random

    rng = random.Random(11)
    table = [b"a", b"b", b"ab", b"ba", b"\xc3", b"\xa9", "é".encode(), b"aab", b"x", b"<s>"]
    special = frozenset({len(table) - 1})
    for trial in range(300):
        stops = rng.sample(["ab", "ba", "aab", "bab", "éa", "xx", "aé", "bbbb", "abab", "aabaa", "abaab",
                            "ababababx", "aaaaaaab"], rng.randrange(1, 4))
        detok = IncrementalDetokenizer(table, special, stop=stops, include_stop_str_in_output=include)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        whole, shown, want_stop = "", "", None
        for _ in range(rng.randrange(1, 40)):
            chunk = [rng.randrange(len(table)) for _ in range(rng.choice((1, 1, 2, 3)))]
            whole += decoder.decode(b"".join(table[t] for t in chunk if t not in special))
            delta = detok.push(chunk)
            shown += delta.text
            hits = [(whole.find(s), k, s) for k, s in enumerate(stops) if s in whole]
            if hits:  # the first to appear: none was in the text before this push
                start, _, want_stop = min(hits)
                cut = whole[:start + len(want_stop) if include else start]
                assert (shown, delta.stop, detok.stopped) == (cut, want_stop, want_stop), (trial, stops)
                assert detok.push([0]).text == "" and detok.flush() == ""
                break
            held = max((k for s in stops for k in range(1, len(s)) if whole.endswith(s[:k])), default=0)
            assert delta.stop is None and shown == whole[:len(whole) - held], (trial, stops)
        if want_stop is None:
            shown += detok.flush()
            assert shown == whole + decoder.decode(b"", final=True), (trial, stops)
        assert detok.text == shown
