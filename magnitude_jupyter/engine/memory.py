"""What a model will hold in memory once loaded, planned from its GGUF metadata before loading it.

llama.cpp allocates four things for a model and one context: the weights (the file, mapped), the KV
cache (`ctx_size` cells x bytes per token, written whole when it is cleared), an output buffer and
a compute buffer (sized for the `n_ubatch` tokens llama.cpp computes at once, dominated by their
logits, and without flash attention by their attention scores too: a row per token, a column per
cell, per head). The output buffer
has a logits row for every sequence of the context, the prefix cache's too, and it is resident
whole (measured: 256 sequences of the bundled model hold 45 MiB more than 16), which is why the
cache's sequences are a setting (`prefix_cache_entries`). The prefix cache's RAM tier comes on top,
filled only as conversations are evicted, up to its limit.

A model with sliding-window layers holds those at a window per sequence (kvmath.py), so for it the KV
cache is `ctx_size` cells of its global layers plus a fixed block of window cells, and each
cache sequence costs a window more (unless `swa_full`).

`ctx_size: auto` runs the same arithmetic backwards: from a memory budget, less the weights, the
buffers and the RAM tier, as many KV cells as the cache type leaves room for, no more than
`parallel` sequences of the trained context, and no fewer than one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import psutil

from ..config import ConfigError, EngineSettings, parse_memory_budget
from ..models.kvmath import KV_BLOCK, KVLayout, kv_layout
from ..models.registry import ModelInfo

FLOAT_BYTES = 4
SCORE_BYTES = 5  # an attention score in llama.cpp's compute buffer, measured (see _scores_bytes_per_cell)
KV_PADDING = KV_BLOCK
UNBOUNDED_CELLS = 1 << 40  # a context no window block reaches


@dataclass(frozen=True)
class MemoryPlan:
    weights: int
    kv_cache: int
    buffers: int  # output + compute buffers
    prefix_cache_ram: int  # at most: the RAM tier's limit

    @property
    def resident(self) -> int:
        """Bytes held as soon as the model has served a request."""
        return self.weights + self.kv_cache + self.buffers

    @property
    def ceiling(self) -> int:
        """Bytes it may come to hold: what a load must find room for."""
        return self.resident + self.prefix_cache_ram

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "resident": self.resident, "ceiling": self.ceiling}


# What a request holds of those cells, by `admission` (docs/decisions.md, "KV cells on demand").
ADMISSION_CHARGE = {
    "reserve": "admission reserve: a request holds its prompt + max_tokens of them from its start",
    "estimate": "admission estimate: a request holds its prompt + its likely answer and grows as it writes",
}

LLAMA_MAX_SEQ = 256  # sequences one llama.cpp context can hold (llama-cparams.h)


def cache_sequences(es: EngineSettings) -> int:
    """Sequence ids for prefix-cache entries: as many as set, within what llama.cpp allows beyond the
    request slots."""
    return min(es.prefix_cache_entries, LLAMA_MAX_SEQ - es.parallel) if es.prefix_reuse else 0


def is_windowed(info: ModelInfo) -> bool:
    """Whether the model has sliding-window layers (as llama.cpp reads them: kvmath.kv_layout)."""
    return bool(info.sliding_window) and any(info.windowed_layers)


def shares_sequences(windowed: bool, es: EngineSettings) -> bool:
    """Whether the prefix cache's entries take their sequence ids from the request slots: on a model
    with sliding-window layers (llama.cpp gives those a window per sequence id), unless `swa_full`."""
    return windowed and not es.swa_full and es.prefix_reuse


def context_sequences(es: EngineSettings, windowed: bool = False) -> int:
    """Every sequence of the context (llama.cpp's n_seq_max): the request slots and the cache's entries,
    or only the slots where entries share them (`shares_sequences`)."""
    return es.parallel if shares_sequences(windowed, es) else es.parallel + cache_sequences(es)


def _buffers(info: ModelInfo, es: EngineSettings, cells: int = 0) -> int:
    """The output buffer and the compute buffer of one step: its logits and a few activations per
    token of the embedding; without flash attention, or the step's attention scores over `cells`,
    whichever needs more."""
    output = _output_buffer(info, es)
    compute = es.ubatch * (info.vocab_size + 4 * info.embedding_length) * FLOAT_BYTES
    return output + max(compute, cells * _scores_bytes_per_cell(info, es))


def _output_buffer(info: ModelInfo, es: EngineSettings) -> int:
    return context_sequences(es, is_windowed(info)) * info.vocab_size * FLOAT_BYTES


def _scores_bytes_per_cell(info: ModelInfo, es: EngineSettings) -> int:
    """Without flash attention, what a cell adds to one piece's attention scores: n_ubatch x heads
    scores at about 5 bytes each (llama.cpp reserved 182 and 357 MiB of compute buffer for the
    bundled model at 8,192 and 16,384 cells, 99 below 4,096, where the logits need more)."""
    return 0 if es.uses_flash_attention else es.ubatch * info.attention_heads * SCORE_BYTES


def plan_kv(info: ModelInfo, es: EngineSettings, cells: int | None = None) -> KVLayout:
    """The KV cache llama.cpp makes for these settings (of `cells`, or the settings' own)."""
    cells = -(-(es.cells if cells is None else cells) // KV_PADDING) * KV_PADDING
    sequences = context_sequences(es, is_windowed(info))
    return kv_layout(info, cells, *es.kv_types, sequences=sequences, batch=es.ubatch, full_windows=es.swa_full)


def _cells_in(info: ModelInfo, es: EngineSettings, kv_bytes: float, extra_per_cell: float = 0) -> int:
    """The most context cells `kv_bytes` hold, each cell costing its KV bytes and `extra_per_cell`."""
    layout = plan_kv(info, es, UNBOUNDED_CELLS)  # the windowed layers' whole block, whatever the context
    per_cell = layout.global_bytes_per_token + layout.window_bytes_per_token + extra_per_cell
    if layout.window is None:
        return int(kv_bytes // per_cell) if per_cell else 0
    # The windowed layers stop growing at their windows: past that, a cell costs the global layers only.
    windows = layout.window_cells
    if kv_bytes >= windows * per_cell:
        return int((kv_bytes - windows * layout.window_bytes_per_token) // (per_cell - layout.window_bytes_per_token))
    return int(kv_bytes // per_cell)


def plan_memory(info: ModelInfo, es: EngineSettings) -> MemoryPlan:
    kv = plan_kv(info, es)
    return MemoryPlan(
        weights=info.file_size,
        kv_cache=kv.bytes,
        buffers=_buffers(info, es, kv.cells),
        prefix_cache_ram=es.prefix_cache_ram_mib << 20,
    )


@dataclass(frozen=True)
class ContextSizing:
    """How `ctx_size: auto` was resolved: the numbers, and the sentence logs and /status show."""

    cells: int
    budget_bytes: int
    kv_bytes_per_token: float
    reason: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _available() -> int:
    return int(psutil.virtual_memory().available)


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def size_context(
    info: ModelInfo,
    es: EngineSettings,
    reserve_bytes: int,
    available_memory: Callable[[], int] = _available,
) -> ContextSizing:
    """The KV cells a memory budget holds (see the module's docstring); a budget that cannot hold one
    sequence of the trained context is a ConfigError with the numbers."""
    raw = parse_memory_budget(es.memory_budget if es.memory_budget is not None else 0.5)
    if isinstance(raw, float):
        free = max(0, available_memory() - reserve_bytes)
        budget = int(raw * free)
        source = f"{raw:g} of the {mib(free)} free (less the {mib(reserve_bytes)} reserve)"
    else:
        budget, source = raw, "memory_budget"
    unit = plan_kv(info, es, KV_PADDING)
    bpt = unit.bytes_per_cell
    buffers, ram = _buffers(info, es), es.prefix_cache_ram_mib << 20
    left = max(0, budget - info.file_size - buffers - ram)
    fits = _cells_in(info, es, left)
    scores = _scores_bytes_per_cell(info, es)
    if scores:  # past some size the scores outgrow the logits' part of the compute buffer
        room = budget - info.file_size - ram - _output_buffer(info, es)
        fits = min(fits, _cells_in(info, es, max(0, room), scores))
    fits = fits // KV_PADDING * KV_PADDING
    ceiling = es.parallel * info.trained_context
    cells = min(fits, ceiling)
    need = info.trained_context
    windows = f" + windowed layers {unit.window_bytes_per_token:,.0f} bytes/token per window" if unit.window else ""
    if cells < need:
        raise ConfigError(
            f"ctx_size auto: a memory budget of {mib(budget)} ({source}) leaves {mib(left)} for the KV cache "
            f"after the weights ({mib(info.file_size)}), buffers ({mib(buffers)}) and the prefix cache's RAM tier "
            f"({mib(ram)}): {fits:,} cells at {bpt:,.0f} bytes/token{windows} ({es.kv_type_label})"
            + (f" and {scores:,} bytes/cell of attention scores (flash_attention off)" if scores else "")
            + f", but one sequence of the trained context needs {need:,} cells "
            f"({mib(plan_kv(info, es, need).bytes + _buffers(info, es, need) - buffers)}). "
            "Give a larger memory_budget, a smaller cache_type, or a ctx_size in tokens."
        )
    why = "parallel x trained context" if cells == ceiling else "what the budget leaves for the cache"
    layout = plan_kv(info, es, cells)
    kv = f"{cells:,} x {bpt:,.0f} bytes/token"
    if layout.window:
        kv += (
            f" + {layout.window_cells:,} window cells x {layout.window_bytes_per_token:,.0f} bytes/token "
            f"(window {layout.window} x {context_sequences(es, True)} sequences + a batch)"
        )
    reason = (
        f"ctx_size auto: {cells:,} cells ({why}); budget {mib(budget)} ({source}): weights {mib(info.file_size)}, "
        f"buffers {mib(_buffers(info, es, cells))}, RAM tier {mib(ram)}, KV cache "
        f"{kv} ({es.kv_type_label}) = {mib(layout.bytes)}; " + ADMISSION_CHARGE[es.admission]
    )
    return ContextSizing(cells, budget, bpt, reason)


def resolve_settings(
    info: ModelInfo, es: EngineSettings, reserve_bytes: int, available_memory: Callable[[], int] = _available
) -> tuple[EngineSettings, ContextSizing | None]:
    """The settings with `ctx_size: auto` replaced by a number of cells (and how), or as they are."""
    if es.ctx_size != "auto":
        return es, None
    sizing = size_context(info, es, reserve_bytes, available_memory)
    return replace(es, ctx_size=sizing.cells, memory_budget=None), sizing
