"""llama.cpp's whole-cache KV state with its cells reordered, before it is loaded back (compaction.py).

The pinned llama.cpp writes a magic number and the sequence saved (-1: all), then each KV cache of
a context in turn (a windowed model's global layers',
then its windowed layers'): its stream count; per stream its cell count, then every cell's position,
sequence count, M-RoPE extras where the model has them and sequence ids; then per layer the cells'
K rows, then their V rows (or, transposed, per channel one element per cell). Loading a whole state
places its cells from the first in the order written, so a state whose cells are written in another
order puts them in that order. Bytes that do not parse as that format are left alone.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

HEADER_BYTES = 8
EXT_BYTES = 12  # llama_kv_cell_ext (x, y, token) per cell, on M-RoPE models
_MAX_TYPE = 64  # ggml types are numbered below this
_MAX_SEQUENCES = 1 << 16


class StateFormatError(ValueError):
    """The bytes are not a whole-cache state as the pinned llama.cpp writes it."""


def grouped_by_sequence(state: bytes | bytearray, first: Sequence[int]) -> bytearray | None:
    """`state` with each cache's cells in this order: the cells of `first[0]` by position, then those
    of `first[1]` not placed yet, and so on, then every other cell in its old order. None where the
    bytes do not parse (the caller loads the state as it was)."""
    for ext in (0, EXT_BYTES):
        try:
            return _reordered(memoryview(state), list(first), ext)
        except (StateFormatError, struct.error, ValueError, IndexError):
            continue
    return None


def _reordered(state: memoryview, first: list[int], ext: int) -> bytearray:
    # The context's header first: a magic number and the sequence saved, -1 for the whole cache.
    if len(state) < HEADER_BYTES or struct.unpack_from("<i", state, 4)[0] != -1:
        raise StateFormatError("not a whole-cache state")
    out = bytearray(state[:HEADER_BYTES])
    offset = HEADER_BYTES
    while offset < len(state):
        offset = _cache(state, offset, first, ext, out)
    if offset != len(state):
        raise StateFormatError("trailing bytes")
    return out


def _u32(state: memoryview, offset: int) -> int:
    return int(struct.unpack_from("<I", state, offset)[0])


def _cache(state: memoryview, offset: int, first: list[int], ext: int, out: bytearray) -> int:
    """Copy one cache's state from `offset` into `out`, its cells reordered; the offset after it."""
    n_stream = _u32(state, offset)
    if not 1 <= n_stream <= _MAX_SEQUENCES:
        raise StateFormatError("stream count")
    out += state[offset : offset + 4]
    offset += 4
    for _ in range(n_stream):
        cells = _u32(state, offset)
        out += state[offset : offset + 4]
        offset += 4
        if cells:
            offset = _stream(state, offset, cells, first, ext, out)
    return offset


def _stream(state: memoryview, offset: int, cells: int, first: list[int], ext: int, out: bytearray) -> int:
    # Every field of the cells' metadata is 4 bytes: read them as ints, one cell after another.
    words = np.frombuffer(state, dtype="<i4", count=(len(state) - offset) // 4, offset=offset)
    spans: list[tuple[int, int]] = []
    positions: list[int] = []
    sequences: list[list[int]] = []
    at, skip = 0, ext // 4
    head = words[: cells * (2 + skip + 4)].tolist()
    for _ in range(cells):
        if at + 2 + skip > len(head):
            head = words[: max(2 * len(head), at + 64)].tolist()
        pos, count = head[at], head[at + 1]
        end = at + 2 + skip + count
        if pos < 0 or not 0 < count <= _MAX_SEQUENCES:
            raise StateFormatError("cell metadata")
        if end > len(head):
            head = words[: max(2 * len(head), end)].tolist()
            if end > len(head):
                raise StateFormatError("cell metadata")
        spans.append((at, end))
        positions.append(pos)
        sequences.append(head[at + 2 + skip : end])
        at = end
    order = _order(positions, sequences, first)
    base = offset
    for i in order:
        start, end = spans[i]
        out += state[base + 4 * start : base + 4 * end]
    offset = base + 4 * at
    return _rows(state, offset, cells, np.asarray(order, dtype=np.intp), out)


def _order(positions: list[int], sequences: list[list[int]], first: list[int]) -> list[int]:
    """Cell indices: each sequence of `first` in turn, by position, then the rest as they were."""
    placed = [False] * len(positions)
    order: list[int] = []
    holders: dict[int, list[int]] = {seq: [] for seq in first}
    for i, seqs in enumerate(sequences):
        for seq in seqs:
            if seq in holders:
                holders[seq].append(i)
    for seq in first:
        mine = [i for i in holders[seq] if not placed[i]]
        mine.sort(key=positions.__getitem__)
        for i in mine:
            placed[i] = True
        order += mine
    order += [i for i, done in enumerate(placed) if not done]
    return order


def _rows(state: memoryview, offset: int, cells: int, order: np.ndarray, out: bytearray) -> int:
    """The layers' K and V rows, each layer's cells in `order`; the offset after them."""
    v_trans, layers = _u32(state, offset), _u32(state, offset + 4)
    if v_trans > 1 or not 0 < layers <= 4096:
        raise StateFormatError("layer header")
    out += state[offset : offset + 8]
    offset += 8
    for _ in range(2 * layers):  # K rows of every layer, then V of every layer
        kind, size = struct.unpack_from("<iQ", state, offset)
        if not 0 <= kind < _MAX_TYPE or size <= 0:
            raise StateFormatError("row header")
        if v_trans and _ >= layers:  # transposed V: element size, channels, then a row per channel
            kind, element, channels = struct.unpack_from("<iII", state, offset)
            out += state[offset : offset + 12]
            offset += 12
            block = channels * cells * element
            channel_rows = np.frombuffer(state, dtype=np.uint8, count=block, offset=offset)
            out += channel_rows.reshape(channels, cells, element)[:, order, :].tobytes()
        else:
            out += state[offset : offset + 12]
            offset += 12
            block = cells * size
            cell_rows = np.frombuffer(state, dtype=np.uint8, count=block, offset=offset)
            out += cell_rows.reshape(cells, size)[order].tobytes()
        offset += block
    return offset
