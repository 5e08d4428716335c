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


def grouped_by_sequence(state: bytes | bytearray, first: Sequence[int]) -> np.ndarray | None:
    """`state` with each cache's cells in this order: the cells of `first[0]` by position, then those
    of `first[1]` not placed yet, and so on, then every other cell in its old order. None where the
    bytes do not parse (the caller loads the state as it was). The bytes come in a new uint8 array,
    left uninitialised before they are written: a state can be hundreds of MB."""
    for ext in (0, EXT_BYTES):
        try:
            return _reordered(np.frombuffer(state, dtype=np.uint8), list(first), ext)
        except (StateFormatError, struct.error, ValueError, IndexError):
            continue
    return None


def _reordered(src: np.ndarray, first: list[int], ext: int) -> np.ndarray:
    # The context's header first: a magic number and the sequence saved, -1 for the whole cache.
    if len(src) < HEADER_BYTES or struct.unpack_from("<i", src.data, 4)[0] != -1:
        raise StateFormatError("not a whole-cache state")
    dst = np.empty(len(src), dtype=np.uint8)
    dst[:HEADER_BYTES] = src[:HEADER_BYTES]
    offset = HEADER_BYTES
    while offset < len(src):
        offset = _cache(src, dst, offset, first, ext)
    if offset != len(src):
        raise StateFormatError("trailing bytes")
    return dst


def _u32(src: np.ndarray, offset: int) -> int:
    return int(struct.unpack_from("<I", src.data, offset)[0])


def _cache(src: np.ndarray, dst: np.ndarray, offset: int, first: list[int], ext: int) -> int:
    """Copy one cache's state at `offset` into `dst`, its cells reordered; the offset after it."""
    n_stream = _u32(src, offset)
    if not 1 <= n_stream <= _MAX_SEQUENCES:
        raise StateFormatError("stream count")
    dst[offset : offset + 4] = src[offset : offset + 4]
    offset += 4
    for _ in range(n_stream):
        cells = _u32(src, offset)
        dst[offset : offset + 4] = src[offset : offset + 4]
        offset += 4
        if cells:
            offset = _stream(src, dst, offset, cells, first, ext)
    return offset


def _stream(src: np.ndarray, dst: np.ndarray, offset: int, cells: int, first: list[int], ext: int) -> int:
    # Every field of the cells' metadata is 4 bytes: a cell is its position, its sequence count, the
    # extras, then that many sequence ids.
    words = src[offset : offset + 4 * ((len(src) - offset) // 4)].view("<i4")
    skip = ext // 4
    starts, counts, used = _records(words, cells, skip)
    positions = words[starts]
    width = int(counts.max())
    ids = np.full((cells, width), -1, dtype=np.int64)
    for count in np.unique(counts).tolist():
        rows = np.nonzero(counts == count)[0]
        ids[rows, :count] = words[starts[rows, None] + 2 + skip + np.arange(count)]
    if (positions < 0).any() or (ids >= _MAX_SEQUENCES).any() or (ids[:, 0] < 0).any():
        raise StateFormatError("cell metadata")
    order = _order(positions, ids, first)
    lengths = (2 + skip + counts)[order]
    begins = np.cumsum(lengths) - lengths
    gather = np.arange(int(lengths.sum())) - np.repeat(begins - starts[order], lengths)
    dst[offset : offset + 4 * used].view("<i4")[:] = words[gather]
    return _rows(src, dst, offset + 4 * used, cells, order)


def _records(words: np.ndarray, cells: int, skip: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Where each cell's record starts (in words) and its sequence count, and the words they take.
    Records of one count follow each other in runs (a sequence's cells, those it shares): each run
    is found at once, its count read at its first record."""
    starts = np.empty(cells, dtype=np.int64)
    counts = np.empty(cells, dtype=np.int64)
    at = done = 0
    while done < cells:
        count = int(words[at + 1])
        if not 0 < count <= _MAX_SEQUENCES:
            raise StateFormatError("cell metadata")
        stride = 2 + skip + count
        room = min(cells - done, 4096, (len(words) - at - 1) // stride + 1)
        if room <= 0:
            raise StateFormatError("cell metadata")
        same = words[at + 1 : at + 1 + stride * room : stride] == count
        run = room if same.all() else int(np.argmin(same))
        starts[done : done + run] = at + stride * np.arange(run)
        counts[done : done + run] = count
        at += stride * run
        done += run
    if at > len(words):
        raise StateFormatError("cell metadata")
    return starts, counts, at


def _order(positions: np.ndarray, ids: np.ndarray, first: list[int]) -> np.ndarray:
    """Cell indices: each sequence of `first` in turn, by position, then the rest as they were."""
    rank = np.full(int(ids.max()) + 2, len(first), dtype=np.int64)  # the last entry: no sequence (-1)
    for k, seq in reversed(list(enumerate(first))):
        if 0 <= seq < len(rank) - 1:
            rank[seq] = k
    cell_rank = rank[ids].min(axis=1)
    within = np.where(cell_rank < len(first), positions, np.arange(len(positions)))
    return np.lexsort((within, cell_rank))


def _rows(src: np.ndarray, dst: np.ndarray, offset: int, cells: int, order: np.ndarray) -> int:
    """The layers' K and V rows, each layer's cells in `order`; the offset after them."""
    v_trans, layers = _u32(src, offset), _u32(src, offset + 4)
    if v_trans > 1 or not 0 < layers <= 4096:
        raise StateFormatError("layer header")
    dst[offset : offset + 8] = src[offset : offset + 8]
    offset += 8
    for block in range(2 * layers):  # K rows of every layer, then V of every layer
        kind, size = struct.unpack_from("<iQ", src.data, offset)
        if not 0 <= kind < _MAX_TYPE or size <= 0:
            raise StateFormatError("row header")
        dst[offset : offset + 12] = src[offset : offset + 12]
        if v_trans and block >= layers:  # transposed V: element size, channels, then a row per channel
            _, element, channels = struct.unpack_from("<iII", src.data, offset)
            offset += 12
            end = offset + channels * cells * element
            if end > len(src):
                raise StateFormatError("rows")
            shape = (channels, cells, element)
            np.take(src[offset:end].reshape(shape), order, axis=1, out=dst[offset:end].reshape(shape))
        else:
            offset += 12
            end = offset + cells * size
            if end > len(src):
                raise StateFormatError("rows")
            np.take(src[offset:end].reshape(cells, size), order, axis=0, out=dst[offset:end].reshape(cells, size))
        offset = end
    return offset
