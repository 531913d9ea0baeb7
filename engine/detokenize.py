"""Incremental detokenization and stop-string matching for one sequence.

Token ids become bytes (the tokenizer's exact table), bytes become text through an
incremental UTF-8 decoder, so a character split over several tokens (byte-fallback
pieces, multi-byte emoji) is emitted only once complete. Stop strings are searched
in the generated text across token boundaries; text that could still turn out to
be the start of a stop string is held back until it cannot, or until the end.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Sequence


@dataclass(slots=True)
class DetokenizedDelta:
    text: str  # new text safe to show
    stop: str | None = None  # the stop string found (the sequence must finish)


class IncrementalDetokenizer:
    """The text of one sequence's tokens, pushed as they come. The text already returned is
    kept as its pieces (`text` joins them once, when asked), so a push costs the same at the
    ten-thousandth token as at the first; only the text not yet returned (what may still be
    the start of a stop string) is searched and held."""

    def __init__(self, token_bytes: Sequence[bytes], special_ids: frozenset[int] = frozenset(),
                 stop: Sequence[str] = (), skip_special_tokens: bool = True,
                 include_stop_str_in_output: bool = False) -> None:
        self._token_bytes = token_bytes
        self._skip = special_ids if skip_special_tokens else frozenset()
        self._pending = b""  # the bytes of a character not complete yet
        self._stops = tuple(stop)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._include_stop = include_stop_str_in_output
        self._shown: list[str] = []  # the text returned so far, in pieces
        self._held = ""  # decoded, not returned: it may begin a stop string
        self.stopped: str | None = None

    @property
    def text(self) -> str:
        """Everything decoded so far (cut at the stop string where one was found)."""
        return "".join(self._shown) + self._held

    def push(self, token_ids: Sequence[int]) -> DetokenizedDelta:
        """Add tokens; returns the text that became safe to emit."""
        if self.stopped is not None:
            return DetokenizedDelta("")
        if len(token_ids) == 1:  # a decode step's token: no generator
            token = token_ids[0]
            data = b"" if token in self._skip else self._token_bytes[token]
        else:
            data = b"".join(self._token_bytes[t] for t in token_ids if t not in self._skip)
        new = self._decode(data)
        if not self._stops:
            return DetokenizedDelta(self._show(new))
        # a stop string cannot begin in the text already returned: that text was held while
        # it could (_held_back), so searching the held text and the new is enough
        held = self._held + new
        hit = self._find_stop(held)
        if hit is not None:
            start, stop = hit
            self.stopped = stop
            self._held = ""
            return DetokenizedDelta(self._show(held[:start + len(stop) if self._include_stop else start]), stop)
        keep = len(held) - self._held_back(held)
        self._held = held[keep:]
        return DetokenizedDelta(self._show(held[:keep]))

    def flush(self) -> str:
        """At the end of generation: release held-back text and any incomplete character."""
        if self.stopped is not None:
            return ""
        rest, self._held = self._held + self._decode(b"", final=True), ""
        return self._show(rest)

    def _decode(self, data: bytes, final: bool = False) -> str:
        """The text of the bytes so far that form whole characters (invalid ones as U+FFFD);
        an incomplete character's bytes wait for the next call, or, final, become U+FFFD.
        codecs' incremental UTF-8 decoder does this in Python around the C function it calls
        (~1 us a token more)."""
        if self._pending:
            data = self._pending + data
        text, used = codecs.utf_8_decode(data, "replace", final)
        self._pending = data[used:]
        return text

    def _show(self, text: str) -> str:
        if text:
            self._shown.append(text)
        return text

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The stop string that begins first in text, and where (the first listed of those
        that begin there)."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            i = text.find(stop)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        return best

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of text (not returned yet) that begins a stop string."""
        tail = text[max(0, len(text) - self._max_stop + 1):]
        longest = 0
        for stop in self._stops:  # its earliest start in the tail that the tail's end continues
            i = tail.find(stop[0], 0, len(tail) - longest)
            while i != -1 and not stop.startswith(tail[i:]):
                i = tail.find(stop[0], i + 1, len(tail) - longest)
            if i != -1:
                longest = len(tail) - i
        return longest
