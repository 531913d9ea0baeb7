"""Incremental detokenization and stop-string matching for one sequence.

Token ids become bytes (the tokenizer's exact table), bytes become text through an
incremental UTF-8 decoder, so a character split over several tokens (byte-fallback
pieces, multi-byte emoji) is emitted only once complete. Stop strings are searched
in the generated text across token boundaries; text that could still turn out to
be the start of a stop string is held back until it cannot, or until the end.

Each stop string is matched as a Knuth-Morris-Pratt automaton fed the new text only: a
push costs O(new characters x stop strings) whatever the strings' lengths, where searching
the held text again at each push costs O(held x length) at a token that breaks a long
partial match (a 1,000-character stop string: milliseconds, held by the engine's thread).
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
        self._borders = [_borders(s) for s in self._stops]
        self._matched = [0] * len(self._stops)  # each stop string's prefix that ends the text so far
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
        held = self._held + new
        hit = self._feed(new)
        if hit is not None:
            start, stop = hit
            start += len(self._held)
            self.stopped = stop
            self._held = ""
            return DetokenizedDelta(self._show(held[:start + len(stop) if self._include_stop else start]), stop)
        # what may still begin a stop string: the longest prefix matched (never longer than
        # the held text and the new, since held was the longest one before)
        keep = len(held) - max(self._matched)
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

    def _feed(self, new: str) -> tuple[int, str] | None:
        """Advance each stop string's automaton over new; the stop string completed in new
        that begins first, and where, counted from new's start (negative: it began in the
        held text), the first listed of those that begin there; else None."""
        best: tuple[int, str] | None = None
        for k, stop in enumerate(self._stops):
            matched = self._matched[k]
            if not matched and stop[0] not in new:  # stays at 0: skip the loop (most strings, most tokens)
                continue
            borders, last = self._borders[k], len(stop) - 1
            for j, c in enumerate(new):
                while matched and stop[matched] != c:
                    matched = borders[matched - 1]
                if stop[matched] == c:
                    if matched == last:  # complete; a later end of this string begins later
                        if best is None or j - last < best[0]:
                            best = (j - last, stop)
                        break
                    matched += 1
            self._matched[k] = matched
        return best


def _borders(s: str) -> list[int]:
    """KMP's table: for each prefix s[:i + 1], the length of its longest proper prefix that
    is also its suffix."""
    table = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = table[k - 1]
        if s[i] == s[k]:
            k += 1
        table[i] = k
    return table
