"""Token pieces to text: incremental UTF-8 decoding and stop strings.

A token can end in the middle of a UTF-8 character, and a stop string can arrive split over
several tokens, so text is held back until it can no longer change: the incomplete bytes of
a character, and any tail that could still grow into a stop string.
"""

from __future__ import annotations

import codecs


class TextAssembler:
    def __init__(self, stop: list[str] | None = None) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = list(stop or [])
        self._pending = ""  # decoded but not yet released: might be the start of a stop string
        self.stopped_by: str | None = None

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is now final (maybe empty)."""
        if self.stopped_by is not None:
            return ""
        self._pending += self._decoder.decode(piece)
        if not self._stop:
            out, self._pending = self._pending, ""
            return out
        cut = self._first_stop()
        if cut is not None:
            index, stop = cut
            self.stopped_by = stop
            out, self._pending = self._pending[:index], ""
            return out
        keep = self._longest_stop_prefix_suffix()
        out = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(out) :]
        return out

    def flush(self) -> str:
        """At the end of generation: release what was held back (it can no longer become a stop)."""
        if self.stopped_by is not None:
            return ""
        out = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        return out

    def _first_stop(self) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = self._pending.find(stop)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _longest_stop_prefix_suffix(self) -> int:
        return held_back(self._pending, self._stop)


def held_back(text: str, marks: list[str]) -> int:
    """Length of the longest end of `text` that starts one of `marks` (it may complete with the next
    token, so it is not released yet)."""
    longest = 0
    for mark in marks:
        for n in range(min(len(mark) - 1, len(text)), longest, -1):
            if text.endswith(mark[:n]):
                longest = n
                break
    return longest
