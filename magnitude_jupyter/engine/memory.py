"""What a model will hold in memory once loaded, planned from its GGUF metadata before loading it.

llama.cpp allocates four things for a model and one context: the weights (the file, mapped), the KV
cache (`ctx_size` cells x bytes per token, written whole when it is cleared), an output buffer and
a compute buffer (sized for one `n_batch` step, dominated by that step's logits). The plan counts
what becomes resident, not what is reserved: the output buffer has a logits row for each of the
256 sequences the engine asks for, but only the `parallel` running ones ever produce one in a step
(prefix-cache sequences never do, and a prompt chunk outputs its last row only), and untouched
pages of a buffer cost no memory. The prefix cache's RAM tier comes on top, filled only as
conversations are evicted, up to its limit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..config import EngineSettings
from ..kvmath import kv_cache_bytes
from ..models import ModelInfo

FLOAT_BYTES = 4
KV_PADDING = 256  # llama.cpp rounds the cache up to whole blocks of cells


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


def plan_memory(info: ModelInfo, es: EngineSettings) -> MemoryPlan:
    cells = -(-es.ctx_size // KV_PADDING) * KV_PADDING
    output = es.parallel * info.vocab_size * FLOAT_BYTES
    # The compute buffer of one step: its logits, and a few activations per token of the embedding.
    compute = es.n_batch * (info.vocab_size + 4 * info.embedding_length) * FLOAT_BYTES
    return MemoryPlan(
        weights=info.file_size,
        kv_cache=kv_cache_bytes(info, cells),
        buffers=output + compute,
        prefix_cache_ram=es.prefix_cache_ram_mib << 20,
    )
