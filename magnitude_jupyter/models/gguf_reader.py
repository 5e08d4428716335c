"""A GGUF header reader that trusts nothing the file says.

Any file in `models_dir` is read when models are listed, so a file is input like a request: every
count and length in its header is checked against the bytes the file has left before anything is
allocated or walked, large arrays (the vocabulary, merges) are skipped over and only counted, and
reading stops with an error past a time limit. Errors say in words what is wrong with the file.
"""

from __future__ import annotations

import mmap
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .chat_formats import VOCAB_MARKERS

READ_SECONDS = 2.0
KEEP_ARRAY_ITEMS = 4096  # arrays up to this long are kept (per-layer values); longer ones only counted
KEEP_STRING_BYTES = 1 << 20  # a longer string value (a chat template is tens of KB) is dropped
KEPT_TEXT_BYTES = 8 << 20  # all kept strings together: a real header keeps well under 1 MiB of text
MAX_DIMS = 4  # GGML_MAX_DIMS

# GGUF value types: their codes and sizes (8 = string, 9 = array).
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
VOCABULARY = "tokenizer.ggml.tokens"  # only counted, and searched for the tokens that tell a chat format
MARKERS = frozenset(marker.encode() for marker in VOCAB_MARKERS)


# The largest value each number read from a header may take before it feeds arithmetic or sizes
# anything: llama.cpp's own limits where it has them (LLAMA_MAX_LAYERS), generous elsewhere.
MAX_LAYERS = 512
MAX_HEADS = 1 << 14
MAX_EMBEDDING = 1 << 20
MAX_HEAD_DIM = 1 << 16
MAX_CONTEXT = 1 << 28
MAX_VOCAB = 1 << 24
MAX_TENSOR_ELEMENTS = 1 << 48


class GGUFError(ValueError):
    """A file that is not a readable GGUF; the message says what is wrong, in words."""


def whole_number(value: Any, key: str, high: int) -> int:
    """A header's number, checked: a whole number from 0 to `high`, else GGUFError naming the key."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GGUFError(f"its metadata {key!r} is {str(value)[:40]!r}, not a number")
    if isinstance(value, float) and not (value == value and abs(value) != float("inf") and value == int(value)):
        raise GGUFError(f"its metadata {key!r} is {value}, not a whole number")
    if not 0 <= value <= high:
        raise GGUFError(f"its metadata {key!r} is {value:,.0f}; a model has from 0 to {high:,}")
    return int(value)


def whole_numbers(value: Any, key: str, high: int, length: int) -> tuple[int, ...]:
    """A per-layer array of numbers (or one number for every layer), each checked."""
    if isinstance(value, list):
        return tuple(whole_number(item, key, high) for item in value[:length])
    return (whole_number(value, key, high),) * length


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    type_id: int

    @property
    def n_elements(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


@dataclass
class GGUFHeader:
    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    array_lengths: dict[str, int] = field(default_factory=dict)  # every array's length, kept or not
    tensors: list[Tensor] = field(default_factory=list)
    vocab_markers: dict[str, int] = field(default_factory=dict)  # chat-format tokens found: text -> id


class _Cursor:
    def __init__(self, data: mmap.mmap | bytes, deadline: float) -> None:
        self.data, self.at, self.deadline, self.steps = data, 0, deadline, 0
        self.kept_bytes = 0  # text kept so far, against KEPT_TEXT_BYTES

    @property
    def left(self) -> int:
        return len(self.data) - self.at

    def tick(self) -> None:
        self.steps += 1
        if self.steps % 4096 == 0 and time.monotonic() > self.deadline:
            raise GGUFError(f"reading its header took over {READ_SECONDS:g} s")

    def take(self, size: int, what: str) -> int:
        if size > self.left:
            raise GGUFError(f"the file ends inside {what} (it is truncated, or its header is corrupt)")
        start = self.at
        self.at += size
        return start

    def scalar(self, code: str, what: str) -> Any:
        size = struct.calcsize("<" + code)
        return struct.unpack_from("<" + code, self.data, self.take(size, what))[0]

    def count(self, what: str, smallest_item: int, unit: str = "entries") -> int:
        """A u64 count of items at least `smallest_item` bytes each, checked against the bytes left."""
        n = self.scalar("Q", what)
        if n * smallest_item > self.left:
            raise GGUFError(
                f"its header says {what} has {n:,} {unit}, more than the {self.left:,} bytes left "
                "in the file can hold (it is truncated, or its header is corrupt)"
            )
        return int(n)

    def string_span(self, what: str) -> tuple[int, int]:
        """Where a string's bytes start, and how many there are."""
        length = self.count(what, 1, "bytes")
        return self.take(length, what), length

    def string(self, what: str, keep: bool = True) -> str | None:
        start, length = self.string_span(what)
        if not keep or length > KEEP_STRING_BYTES:
            return None
        self.kept_bytes += length
        if self.kept_bytes > KEPT_TEXT_BYTES:
            raise GGUFError(
                f"its header holds over {KEPT_TEXT_BYTES >> 20} MiB of metadata text; a model's header holds far less"
            )
        return bytes(self.data[start : start + length]).decode("utf-8", errors="replace")


def _value(cur: _Cursor, kind: int, key: str, header: GGUFHeader) -> Any:
    if kind in SCALARS:
        return cur.scalar(SCALARS[kind], f"the value of {key!r}")
    if kind == STRING:
        return cur.string(f"the value of {key!r}")
    if kind != ARRAY:
        raise GGUFError(f"metadata {key!r} has an unknown value type {kind}")
    item_kind = cur.scalar("I", f"the array {key!r}")
    if item_kind in SCALARS:
        size = struct.calcsize("<" + SCALARS[item_kind])
        n = cur.count(f"the array {key!r}", size)
        header.array_lengths[key] = n
        start = cur.take(n * size, f"the array {key!r}")
        if n > KEEP_ARRAY_ITEMS:
            return None
        return list(struct.unpack_from(f"<{n}{SCALARS[item_kind]}", cur.data, start))
    if item_kind == STRING:
        n = cur.count(f"the array {key!r}", 8)
        header.array_lengths[key] = n
        if key == VOCABULARY:
            _note_markers(cur, n, header)
            return None
        keep = n <= KEEP_ARRAY_ITEMS
        items = []
        for _ in range(n):
            cur.tick()
            items.append(cur.string(f"an item of the array {key!r}", keep))
        return items if keep else None
    raise GGUFError(f"the array {key!r} holds values of type {item_kind}, which GGUF does not nest here")


def _note_markers(cur: _Cursor, n: int, header: GGUFHeader) -> None:
    """Walk the vocabulary, noting the ids of the tokens that tell a chat format (chat_formats.py)."""
    longest = max(map(len, MARKERS))
    for token_id in range(n):
        cur.tick()
        start, length = cur.string_span("an entry of the vocabulary")
        if length <= longest:
            text = bytes(cur.data[start : start + length])
            if text in MARKERS:
                header.vocab_markers[text.decode()] = token_id


def read_header(path: str | Path, seconds: float = READ_SECONDS) -> GGUFHeader:
    """The metadata and tensor list of a GGUF file; raises GGUFError for anything malformed."""
    deadline = time.monotonic() + seconds
    with open(path, "rb") as fh:
        size = Path(path).stat().st_size
        if size < 24:
            raise GGUFError(f"the file is {size} bytes, too short for a GGUF header")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse(_Cursor(data, deadline))


def _parse(cur: _Cursor) -> GGUFHeader:
    magic = bytes(cur.data[:4])
    if magic != b"GGUF":
        raise GGUFError(f"it is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    cur.at = 4
    version = cur.scalar("I", "the version")
    if version not in (2, 3):
        raise GGUFError(f"GGUF version {version} is not supported (versions 2 and 3 are)")
    header = GGUFHeader(version)
    n_tensors = cur.count("the tensor list", 8 + 4 + 4 + 8)
    n_metadata = cur.count("the metadata", 8 + 4)
    for _ in range(n_metadata):
        cur.tick()
        key = cur.string("a metadata key") or ""
        kind = cur.scalar("I", f"the type of {key!r}")
        header.metadata[key] = _value(cur, kind, key, header)
    for _ in range(n_tensors):
        cur.tick()
        name = cur.string("a tensor name") or ""
        dims = cur.scalar("I", f"the dimensions of tensor {name!r}")
        if not 1 <= dims <= MAX_DIMS:
            raise GGUFError(f"tensor {name!r} has {dims} dimensions; GGUF allows 1 to {MAX_DIMS}")
        shape = tuple(int(cur.scalar("Q", f"the shape of tensor {name!r}")) for _ in range(dims))
        elements = 1
        for size in shape:
            elements *= size
        if elements > MAX_TENSOR_ELEMENTS:
            raise GGUFError(f"tensor {name!r} has shape {shape}, over {MAX_TENSOR_ELEMENTS:,} values")
        type_id = cur.scalar("I", f"the type of tensor {name!r}")
        cur.scalar("Q", f"the offset of tensor {name!r}")
        header.tensors.append(Tensor(name, shape, int(type_id)))
    return header
