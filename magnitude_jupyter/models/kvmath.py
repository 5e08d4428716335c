"""KV-cache arithmetic: bytes per token from a model's shape and the cache type.

Bytes per token count only the KV heads, not the attention heads: with grouped-query
attention (SmolLM2: 9 heads, 3 KV heads) the common "2 x layers x hidden x bytes" formula
overstates the cache by the ratio of the two. Pure functions, shared by the engine, the CLI
and calibration.

Sliding-window layers (Gemma 2/3, gpt-oss, Cohere 2) attend to the last `window` tokens only.
llama.cpp gives them a cache of their own (llama-kv-cache-iswa.cpp): a window of cells per
sequence and one batch more, in blocks of 256, never more than the context. So a model's KV
memory is

    cells x (global layers' bytes per token) + window cells x (windowed layers' bytes per token)

and a session of T tokens costs T x the first plus min(T, window) x the second, where a
full-attention model costs T x all layers' bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

KV_BLOCK = 256  # llama.cpp rounds each cache up to whole blocks of cells

# Bytes per element of each KV cache type llama.cpp accepts (block formats: bytes per block / 32).
CACHE_TYPE_BYTES: dict[str, float] = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q5_1": 24 / 32,
    "q5_0": 22 / 32,
    "q4_1": 20 / 32,
    "q4_0": 18 / 32,
}


class KVShape(Protocol):
    @property
    def kv_heads_per_layer(self) -> tuple[int, ...]: ...
    @property
    def head_dim_k(self) -> int: ...
    @property
    def head_dim_v(self) -> int: ...


def kv_bytes_per_token(
    shape: KVShape, cache_type_k: str = "f16", cache_type_v: str | None = None, layers: Sequence[bool] | None = None
) -> float:
    """Bytes one token occupies in the KV cache, K and V together, over all layers (or those
    `layers` marks True)."""
    try:
        bytes_k = CACHE_TYPE_BYTES[cache_type_k]
        bytes_v = CACHE_TYPE_BYTES[cache_type_v or cache_type_k]
    except KeyError as exc:
        raise ValueError(f"unknown KV cache type {exc.args[0]!r}; known: {', '.join(CACHE_TYPE_BYTES)}") from None
    heads = shape.kv_heads_per_layer
    if layers is not None:
        heads = tuple(h for h, counted in zip(heads, layers, strict=False) if counted)
    return float(sum(h * (shape.head_dim_k * bytes_k + shape.head_dim_v * bytes_v) for h in heads))


Window = tuple[int, float]  # a model's windowed layers: (tokens they see, bytes a token costs there)


def session_bytes(tokens: int, bytes_per_token: float, window: Window | None = None) -> float:
    """KV bytes of one sequence of `tokens`: every token at `bytes_per_token` (the global layers', or
    every layer's without windows), and its last window in the windowed layers."""
    if window is None:
        return tokens * bytes_per_token
    return tokens * bytes_per_token + min(tokens, window[0]) * window[1]


def window_cells(window: int, sequences: int, batch: int, cells: int) -> int:
    """Cells of each sliding-window layer's cache: a window per sequence and a batch, in whole
    blocks, within the context's `cells` (llama-kv-cache-iswa.cpp)."""
    return -(-min(cells, window * sequences + batch) // KV_BLOCK) * KV_BLOCK


@dataclass(frozen=True)
class KVLayout:
    """The KV cache of one context: its global layers hold `cells`, its windowed layers `window_cells`."""

    cells: int
    window_cells: int
    global_bytes_per_token: float  # the layers that see the whole context
    window_bytes_per_token: float  # the sliding-window layers (0 for a model without them)
    window: int | None  # tokens each windowed layer sees; None when the windows are full-size or absent

    @property
    def bytes(self) -> int:
        return round(self.cells * self.global_bytes_per_token + self.window_cells * self.window_bytes_per_token)

    @property
    def bytes_per_cell(self) -> float:
        """What one more cell of context costs: every layer's bytes, or the global layers' when the
        windowed layers stop at their windows."""
        return self.global_bytes_per_token + (0.0 if self.window else self.window_bytes_per_token)

    def window_json(self) -> dict[str, float] | None:
        """The windowed layers' cache, for /status (None without windows)."""
        if not self.window:
            return None
        return {"window": self.window, "cells": self.window_cells, "bytes_per_token": self.window_bytes_per_token}

    @property
    def windowed(self) -> Window | None:
        """(tokens, bytes per token) of the windowed layers where they keep windows, for session_bytes."""
        return (self.window, self.window_bytes_per_token) if self.window else None

    def session_bytes(self, tokens: int) -> float:
        """What one sequence of `tokens` holds: every token in the global layers, its last window in
        the windowed ones."""
        return session_bytes(tokens, self.bytes_per_cell, self.windowed)


class WindowedShape(KVShape, Protocol):
    @property
    def windowed_layers(self) -> tuple[bool, ...]: ...
    @property
    def sliding_window(self) -> int | None: ...


def kv_layout(
    shape: WindowedShape,
    cells: int,
    cache_type_k: str = "f16",
    cache_type_v: str | None = None,
    sequences: int = 1,
    batch: int = 512,
    full_windows: bool = False,
) -> KVLayout:
    """The cache llama.cpp makes for `cells` over `sequences` (windowed layers at full size when
    `full_windows`, as llama.cpp's swa_full)."""
    windowed = shape.windowed_layers if shape.sliding_window else ()
    if not any(windowed):
        bpt = kv_bytes_per_token(shape, cache_type_k, cache_type_v)
        return KVLayout(cells, 0, bpt, 0.0, None)
    glob = kv_bytes_per_token(shape, cache_type_k, cache_type_v, [not w for w in windowed])
    swa = kv_bytes_per_token(shape, cache_type_k, cache_type_v, windowed)
    assert shape.sliding_window is not None
    if full_windows:
        return KVLayout(cells, cells, glob, swa, None)
    return KVLayout(cells, window_cells(shape.sliding_window, sequences, batch, cells), glob, swa, shape.sliding_window)


def kv_cache_bytes(shape: KVShape, tokens: int, cache_type_k: str = "f16", cache_type_v: str | None = None) -> int:
    return round(kv_bytes_per_token(shape, cache_type_k, cache_type_v) * tokens)


def tokens_that_fit(memory_bytes: int, bytes_per_token: float) -> int:
    return int(memory_bytes // bytes_per_token) if bytes_per_token > 0 else 0
