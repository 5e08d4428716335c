"""Embeddings: a llama.cpp context of their own on the loaded weights, pooled and normalized.

The context is made on first use, with embeddings on and the GGUF's pooling type (mean where the
file names none: a causal chat model has no pooling of its own). Inputs are packed into as few
`llama_decode` calls as fit its batch, one sequence each. It runs on the calling thread, never the
engine's: generation goes on beside it (the two share the CPU, not a step).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import llama_cpp
import numpy as np

from .runner_api import EMBED_CTX, EmbeddingCancelled, EmbeddingError

EMBED_SEQUENCES = 64  # inputs decoded together at most
# Short inputs are packed up to this many tokens a call: attention spans every token of a call
# (docs/decisions.md, "Embeddings"); a longer input still goes alone.
EMBED_PACK_TOKENS = 512


class Embedder:
    def __init__(self, model: Any, n_threads: int, trained_context: int) -> None:
        self.model = model
        self.n_ctx = min(EMBED_CTX, trained_context or EMBED_CTX)
        self.n_embd = int(llama_cpp.llama_model_n_embd(model))
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model)))
        self._lock = threading.Lock()
        self.ctx = self._context(n_threads, llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED)
        if llama_cpp.llama_pooling_type(self.ctx) == llama_cpp.LLAMA_POOLING_TYPE_NONE:
            llama_cpp.llama_free(self.ctx)
            self.ctx = self._context(n_threads, llama_cpp.LLAMA_POOLING_TYPE_MEAN)
        self.pooling = int(llama_cpp.llama_pooling_type(self.ctx))
        self.batch = llama_cpp.llama_batch_init(self.n_ctx, 0, EMBED_SEQUENCES)

    def _context(self, n_threads: int, pooling: int) -> Any:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = self.n_ctx
        params.n_batch = params.n_ubatch = self.n_ctx
        params.n_seq_max = EMBED_SEQUENCES
        params.n_threads = params.n_threads_batch = n_threads
        params.embeddings = True
        params.pooling_type = pooling
        params.kv_unified = True
        params.no_perf = True
        ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not ctx:
            raise RuntimeError("llama.cpp could not create an embedding context")
        return ctx

    def embed(self, inputs: Sequence[Sequence[int]], stop: threading.Event | None = None) -> list[np.ndarray]:
        """One unit vector per token list, in order; raises EmbeddingCancelled once `stop` is set
        (checked between decode calls)."""
        for i, tokens in enumerate(inputs):
            if not tokens:
                raise EmbeddingError(f"input {i} is empty")
            if len(tokens) > self.n_ctx:
                raise EmbeddingError(f"input {i} is {len(tokens)} tokens; one input holds at most {self.n_ctx}")
            if min(tokens) < 0 or max(tokens) >= self.n_vocab:
                raise EmbeddingError(
                    f"input {i} holds a token id outside this model's vocabulary (0 to {self.n_vocab - 1})"
                )
        out: list[np.ndarray] = []
        with self._lock:
            group: list[Sequence[int]] = []
            for tokens in inputs:
                full = len(group) == EMBED_SEQUENCES or sum(map(len, group)) + len(tokens) > EMBED_PACK_TOKENS
                if group and full:
                    if stop is not None and stop.is_set():
                        raise EmbeddingCancelled("the client went away")
                    out += self._decode(group)
                    group = []
                group.append(tokens)
            if group:
                out += self._decode(group)
        return out

    def _decode(self, group: list[Sequence[int]]) -> list[np.ndarray]:
        batch = self.batch
        n = 0
        for seq, tokens in enumerate(group):
            for pos, token in enumerate(tokens):
                batch.token[n] = int(token)
                batch.pos[n] = pos
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq
                batch.logits[n] = True  # pooling reads every token's output
                n += 1
        batch.n_tokens = n
        # Each call starts on empty cells; their contents need no zeroing (docs/decisions.md, "Embeddings").
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), False)
        status = llama_cpp.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status} for embeddings")
        vectors = []
        for seq in range(len(group)):
            pointer = llama_cpp.llama_get_embeddings_seq(self.ctx, seq)
            if not pointer:
                raise RuntimeError("llama.cpp returned no pooled embedding")
            vector = np.ctypeslib.as_array(pointer, shape=(self.n_embd,)).astype(np.float32)
            norm = float(np.linalg.norm(vector))
            vectors.append(vector / norm if norm > 0 else vector)
        return vectors

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
