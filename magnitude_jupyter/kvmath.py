"""KV-cache arithmetic: bytes per token from a model's shape and the cache type.

Bytes per token count only the KV heads, not the attention heads: with grouped-query
attention (SmolLM2: 9 heads, 3 KV heads) the common "2 x layers x hidden x bytes" formula
overstates the cache by the ratio of the two. Pure functions, shared by the engine, the CLI
and calibration.
"""

from __future__ import annotations

from typing import Protocol

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


def kv_bytes_per_token(shape: KVShape, cache_type_k: str = "f16", cache_type_v: str | None = None) -> float:
    """Bytes one token occupies in the KV cache, over all layers, K and V together."""
    try:
        bytes_k = CACHE_TYPE_BYTES[cache_type_k]
        bytes_v = CACHE_TYPE_BYTES[cache_type_v or cache_type_k]
    except KeyError as exc:
        raise ValueError(f"unknown KV cache type {exc.args[0]!r}; known: {', '.join(CACHE_TYPE_BYTES)}") from None
    return float(sum(h * (shape.head_dim_k * bytes_k + shape.head_dim_v * bytes_v) for h in shape.kv_heads_per_layer))


def kv_cache_bytes(shape: KVShape, tokens: int, cache_type_k: str = "f16", cache_type_v: str | None = None) -> int:
    return round(kv_bytes_per_token(shape, cache_type_k, cache_type_v) * tokens)


def tokens_that_fit(memory_bytes: int, bytes_per_token: float) -> int:
    return int(memory_bytes // bytes_per_token) if bytes_per_token > 0 else 0
