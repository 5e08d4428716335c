"""The prefix cache's host memory: saved sequences and window checkpoints, within one byte limit.

A saved sequence (`llama_state_seq_get_data`) is an entry evicted from the KV cells, restored when
its conversation returns. A window checkpoint is the state of a sequence's sliding-window layers only
(`LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`) at the end of a prompt: those layers keep a window of cells per
sequence, so a later prompt that matches a cached entry only part of the way cannot go on from there
without the window before it (prefix_cache.py, "Sliding windows"); with the checkpoint loaded over
the tree's cells it can, as llama.cpp's server does with its context checkpoints. A checkpoint comes
in at the cost of what was used least recently, whichever kind that is; a saved entry at the cost
of checkpoints first, as `has_room` counts: a sequence moved out for it is not to push out one
saved before it while checkpoints remain.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

SavedState = bytes | bytearray  # a sequence's KV state (`llama_state_seq_get_data`), as the RAM tier keeps it


class RamMatch(NamedTuple):
    tokens: tuple[int, ...]  # the saved entry to restore (empty: none)
    length: int  # the prompt tokens it covers
    longest: int  # the most any entry shares with the prompt, usable or not
    longest_tokens: tuple[int, ...] = ()  # the entry that shares it


class WindowCheckpoint(NamedTuple):
    length: int  # the prompt tokens before it: a request goes on from here
    data: SavedState


class RamTier:
    """Saved sequence states and window checkpoints in host memory, least recently used dropped first,
    within `capacity_bytes`."""

    def __init__(self, capacity_bytes: int, bytes_per_token: float = 0.0) -> None:
        """`bytes_per_token`: what a saved state takes per token, if known; the largest seen counts."""
        self.capacity_bytes = capacity_bytes
        self.bytes_per_token = bytes_per_token
        self.entries: OrderedDict[tuple[int, ...], SavedState] = OrderedDict()
        self.floors: dict[tuple[int, ...], int] = {}  # where each one's windowed cells are whole from
        self.windows: dict[tuple[int, ...], SavedState] = {}  # window checkpoints, by the tokens before them
        self._order: OrderedDict[tuple[bool, tuple[int, ...]], None] = OrderedDict()  # (is a checkpoint, tokens)
        self.bytes = 0
        self.entry_bytes = 0  # of saved entries only: checkpoints may give way to them (`has_room`)

    def has_room(self, n_tokens: int, pending_tokens: int = 0) -> bool:
        """Whether a saved state of `n_tokens` fits beside the saved entries kept and `pending_tokens` on
        their way in (as far as the states saved so far tell); window checkpoints, a cache of what
        entries hold, may give way."""
        return (n_tokens + pending_tokens) * self.bytes_per_token <= self.capacity_bytes - self.entry_bytes

    def put(self, tokens: tuple[int, ...], data: SavedState, window_floor: int = 0) -> None:
        self.bytes_per_token = max(self.bytes_per_token, len(data) / max(1, len(tokens)))
        if len(data) > self.capacity_bytes:
            return
        self.pop(tokens)
        self.entries[tokens] = data
        self.floors[tokens] = window_floor
        self.entry_bytes += len(data)
        self._add((False, tokens), len(data), windows_first=True)

    def pop(self, tokens: tuple[int, ...]) -> SavedState | None:
        data = self.entries.pop(tokens, None)
        if data is not None:
            del self.floors[tokens]
            del self._order[(False, tokens)]
            self.bytes -= len(data)
            self.entry_bytes -= len(data)
        return data

    def put_window(self, tokens: tuple[int, ...], data: SavedState) -> None:
        """Keep the window checkpoint taken after `tokens` (replacing one taken after the same tokens)."""
        if len(data) > self.capacity_bytes:
            return
        self.drop_window(tokens)
        self.windows[tokens] = data
        self._add((True, tokens), len(data))

    def drop_window(self, tokens: tuple[int, ...]) -> None:
        data = self.windows.pop(tokens, None)
        if data is not None:
            del self._order[(True, tokens)]
            self.bytes -= len(data)

    def window_for(self, prompt: Sequence[int], above: int, limit: int) -> WindowCheckpoint | None:
        """The checkpoint taken after the longest prefix of `prompt` longer than `above` tokens and at
        most `limit`; the one found counts as just used."""
        found: tuple[int, ...] = ()
        for tokens in self.windows:
            n = len(tokens)
            # (the last token first: a cheap test that fails for nearly every other prompt)
            if above < n <= limit and n > len(found) and prompt[n - 1] == tokens[-1] and tuple(prompt[:n]) == tokens:
                found = tokens
        if not found:
            return None
        self._order.move_to_end((True, found))
        return WindowCheckpoint(len(found), self.windows[found])

    def _add(self, key: tuple[bool, tuple[int, ...]], size: int, windows_first: bool = False) -> None:
        """Count `key` in, then drop the least recently used until the tier is within its limit: of the
        checkpoints first while there are any, with `windows_first`."""
        self._order[key] = None
        self.bytes += size
        while self.bytes > self.capacity_bytes:
            if windows_first and self.windows:
                self.drop_window(next(tokens for is_window, tokens in self._order if is_window))
                continue
            is_window, tokens = next(iter(self._order))
            if is_window:
                self.drop_window(tokens)
            else:
                self.pop(tokens)

    def best(self, prompt: Sequence[int], limit: int, usable: Callable[[int, int], bool] | None = None) -> RamMatch:
        """The saved entry that shares the longest prefix with `prompt` (at most `limit` tokens; with
        `usable`, only where it says the prefix's length and the entry's window floor can be used),
        and the longest prefix any entry shares, usable or not: one scan for both. Of entries that
        share as much, the longest: a conversation's latest turn holds its earlier ones, and the
        tokens after the shared prefix may still be the prompt's own, spelled otherwise
        (`PrefixCache.respelled` walks them once the entry is back)."""
        tokens: tuple[int, ...] = ()
        longest_tokens: tuple[int, ...] = ()
        length = longest = 0
        for saved in self.entries:
            # An entry changes nothing unless it shares at least `length` tokens (longest >= length):
            # one token's test skips nearly all of them once a long match is found.
            if length and (len(saved) < length or saved[length - 1] != prompt[length - 1]):
                continue
            n = common_prefix_len(saved, prompt, limit)
            if n > longest or (n and n == longest and len(saved) > len(longest_tokens)):
                longest, longest_tokens = n, saved
            if (n > length or (n and n == length and len(saved) > len(tokens))) and (
                usable is None or usable(n, self.floors[saved])
            ):
                tokens, length = saved, n
        return RamMatch(tokens, length, longest, longest_tokens)


def common_prefix_len(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """How many tokens `a` and `b` share from the start (at most `limit`). Slices compare in C: a
    bisection over them, not a loop in Python, since every prompt of a conversation workload shares
    its long system prompt with every saved entry (docs/decisions.md, "Of saved entries that share
    as much of a prompt, the longest comes back")."""
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    if n == 0 or a[0] != b[0]:
        return 0
    a_part, b_part = (a[:n], b[:n])
    if tuple(a_part) == tuple(b_part):
        return n
    lo, hi = 1, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tuple(a_part[lo:mid]) == tuple(b_part[lo:mid]):
            lo = mid
        else:
            hi = mid
    return lo
