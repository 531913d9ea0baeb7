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


@dataclass
class DetokenizedDelta:
    text: str  # new text safe to show
    stop: str | None = None  # the stop string found (the sequence must finish)


class IncrementalDetokenizer:
    def __init__(self, token_bytes: Sequence[bytes], special_ids: frozenset[int] = frozenset(),
                 stop: Sequence[str] = (), skip_special_tokens: bool = True,
                 include_stop_str_in_output: bool = False) -> None:
        self._token_bytes = token_bytes
        self._skip = special_ids if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = tuple(stop)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._include_stop = include_stop_str_in_output
        self.text = ""  # everything decoded so far
        self._emitted = 0  # chars of self.text already returned
        self.stopped: str | None = None

    def push(self, token_ids: Sequence[int]) -> DetokenizedDelta:
        """Add tokens; returns the text that became safe to emit."""
        if self.stopped is not None:
            return DetokenizedDelta("")
        data = b"".join(self._token_bytes[t] for t in token_ids if t not in self._skip)
        before = len(self.text)
        self.text += self._decoder.decode(data)
        if self._stops:
            hit = self._find_stop(max(0, before - self._max_stop + 1))
            if hit is not None:
                start, stop = hit
                end = start + len(stop) if self._include_stop else start
                self.stopped = stop
                self.text = self.text[:end]
                return DetokenizedDelta(self._take(end), stop)
            return DetokenizedDelta(self._take(len(self.text) - self._held_back()))
        return DetokenizedDelta(self._take(len(self.text)))

    def flush(self) -> str:
        """At the end of generation: release held-back text and any incomplete character."""
        if self.stopped is None:
            self.text += self._decoder.decode(b"", final=True)
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted:end]
        self._emitted = end
        return out

    def _find_stop(self, search_from: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            i = self.text.find(stop, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        return best

    def _held_back(self) -> int:
        """Length of the longest tail of the unemitted text that begins a stop string."""
        tail = self.text[max(self._emitted, len(self.text) - self._max_stop + 1):]
        for k in range(len(tail), 0, -1):
            suffix = tail[-k:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return k
        return 0
