"""Prompt-prefix reuse: a new sequence starts from KV cells another sequence already computed.

Batch rows share a long instruction prefix (system prompt plus the template's fixed text), and
prefill is where their time goes. In a unified KV cache, `llama_memory_seq_cp` lets a new
sequence share those cells at no cost, so the scheduler looks for the longest prefix it can
copy: from a running request, or from one retained prefix slot that outlives the requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def common_prefix_len(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class PrefixCopy:
    """Copy cells [0, length) of `src_seq` into `dst_seq` before the step's decode."""

    src_seq: int
    dst_seq: int
    length: int


@dataclass
class ClearSequence:
    """Drop every cell of `seq_id` (the prefix slot, before it takes a new prefix)."""

    seq_id: int


KVOp = PrefixCopy | ClearSequence  # applied in order before the step's decode


@dataclass
class PrefixSlot:
    """One extra sequence id that keeps the most recently shared prefix after its requests end."""

    seq_id: int
    tokens: list[int] = field(default_factory=list)
    # The running request whose cells the slot shares (it copied them from it), or None: then the
    # slot's cells are its own, as after that request ended.
    shares_with: str | None = None

    @property
    def length(self) -> int:
        return len(self.tokens)
