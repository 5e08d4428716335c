"""The KV-cache operations the prefix cache and the scheduler decide and the runner carries out, in
order (`runner_api.apply_kv_ops`): the cache only decides, as data, and never calls llama.cpp."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .ram_tier import SavedState


@dataclass
class CopyCells:
    """`dst_seq` shares the cells of `src_seq` for positions [start, end)."""

    src_seq: int
    dst_seq: int
    start: int
    end: int


@dataclass
class ClearSequence:
    """Drop every cell of `seq_id` (cells other sequences share stay)."""

    seq_id: int


@dataclass
class TrimSequence:
    """Drop the cells of `seq_id` from position `start` on (cells other sequences share stay)."""

    seq_id: int
    start: int


@dataclass
class TakeTreeCells:
    """`seq_id` drops its cells of positions [0, end) and shares `holder`'s there instead: a request's
    sequence kept as an entry holds the tree's own cells for the part the tree had (never the same
    tokens twice)."""

    seq_id: int
    holder: int
    end: int


@dataclass
class SaveSequence:
    """Save the state of `seq_id` (its `tokens`) to the RAM tier before it is cleared (its windowed
    layers' cells whole from `window_floor`)."""

    seq_id: int
    tokens: tuple[int, ...]
    window_floor: int = 0


@dataclass
class RestoreSequence:
    """Load a saved state into `seq_id`, then replace its first `shared` cells with those of `shared_from`
    (the tree's own cells for the part it already holds)."""

    seq_id: int
    data: SavedState
    shared: int = 0
    shared_from: int | None = None


@dataclass
class SaveWindow:
    """Keep a window checkpoint of `seq_id`, which holds the cells of `tokens` and no more, in the RAM
    tier (see "Sliding windows")."""

    seq_id: int
    tokens: tuple[int, ...]


@dataclass
class LoadWindow:
    """Load a window checkpoint over the windowed layers' cells of `seq_id`, which has just copied the
    tree's cells before it; `refused` is called if llama.cpp finds no cells for it, after the
    sequence's cells are gone (the request then computes its prompt whole)."""

    seq_id: int
    data: SavedState
    refused: Callable[[], None]


@dataclass
class SuspendSequence:
    """A preempted request's sequence comes off (scheduler.py, "Preemption"): its sampler is kept
    under `key`; `keep` receives the saved state of a lane (None otherwise)."""

    seq_id: int
    key: str
    keep: Callable[[SavedState | None], None]


@dataclass
class ForgetSuspended:
    """A preempted request ended before it resumed: what the runner kept for it goes."""

    key: str


KVOp = (
    CopyCells
    | ClearSequence
    | TrimSequence
    | TakeTreeCells
    | SaveSequence
    | RestoreSequence
    | SaveWindow
    | LoadWindow
    | SuspendSequence
    | ForgetSuspended
)
