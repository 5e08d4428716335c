"""What a quantized KV cache costs in accuracy, measured rather than assumed.

The same texts go through a runner with each cache type, teacher-forced one token at a time (every
step attends over what the cache stored, as decoding does), and each step's logits are compared
with the f16 cache's: how often the top token agrees, and the mean |Δlogit|. Then each type
continues the texts greedily, and the first position where its tokens leave f16's says how soon a
user would see a different answer.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..engine.plan import DecodeItem
from ..engine.request import SamplingParams
from ..engine.runner import LlamaRunner
from ..engine.threads import threads_free_now

SEQ = 0


def forced_logits(runner: LlamaRunner, tokens: Sequence[int]) -> np.ndarray:
    """Row i: the logits after tokens[0..i], each token decoded on its own (rows predict tokens[1:])."""
    rows = []
    for position, token in enumerate(tokens[:-1]):
        (row,) = runner.decode([DecodeItem(SEQ, [token], position, True)])
        assert row is not None
        rows.append(runner.logits(row))
    runner.end_sequence(SEQ)
    return np.stack(rows)


def greedy_tokens(runner: LlamaRunner, prompt: Sequence[int], n: int) -> list[int]:
    runner.start_sequence(SEQ, SamplingParams(temperature=0), prompt, len(prompt))
    (row,) = runner.decode([DecodeItem(SEQ, prompt, 0, True)])
    out: list[int] = []
    for i in range(n):
        assert row is not None
        token = runner.sample(SEQ, row)
        out.append(token)
        (row,) = runner.decode([DecodeItem(SEQ, [token], len(prompt) + i, True)])
    runner.end_sequence(SEQ)
    return out


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ, or None when they agree throughout."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


@dataclass(frozen=True)
class CacheQuality:
    cache_type: str
    positions: int  # teacher-forced steps compared
    top1_agreement: float  # share of steps whose top token is f16's
    mean_abs_dlogit: float  # over every step and vocabulary entry
    divergence: list[int | None]  # per text: first greedy token unlike f16's (None: all alike)
    greedy_tokens: int

    @property
    def median_divergence(self) -> float:
        """The median first differing token; a text that never diverged counts as `greedy_tokens`."""
        return statistics.median(self.greedy_tokens if d is None else d for d in self.divergence)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "median_divergence": self.median_divergence}


def measure(
    model_path: str | Path,
    texts: Sequence[str],
    cache_types: Sequence[str] = ("f16", "q8_0", "q4_0"),
    greedy: int = 64,
    threads: int | None = None,
    reference: str = "f16",
) -> list[CacheQuality]:
    """Each cache type against `reference`, on the same texts (the reference compared with itself
    too: it must come out exact, or the measurement itself is noisy). `threads`: default, the cores
    other processes leave free (engine/threads.py: a thread on a busy core stalls every step)."""
    threads = threads or threads_free_now()
    seen: dict[str, tuple[list[np.ndarray], list[list[int]], list[list[int]]]] = {}
    for cache_type in dict.fromkeys([reference, *cache_types]):
        runner = LlamaRunner(model_path, n_ctx=2048, n_seq_max=1, n_threads=threads, cache_types=(cache_type,) * 2)
        try:
            prompts = [runner.tokenize(text) for text in texts]
            logits = [forced_logits(runner, tokens) for tokens in prompts]
            # Continue from the first half of each text: long enough to lean on the cache.
            continued = [greedy_tokens(runner, tokens[: max(2, len(tokens) // 2)], greedy) for tokens in prompts]
        finally:
            runner.close()
        seen[cache_type] = (logits, continued, prompts)
    ref_logits, ref_greedy, _ = seen[reference]
    out = []
    for cache_type in cache_types:
        logits, continued, _ = seen[cache_type]
        ref_all, all_ = np.concatenate(ref_logits), np.concatenate(logits)
        agree = float(np.mean(ref_all.argmax(axis=1) == all_.argmax(axis=1)))
        out.append(
            CacheQuality(
                cache_type=cache_type,
                positions=len(all_),
                top1_agreement=agree,
                mean_abs_dlogit=float(np.mean(np.abs(ref_all - all_))),
                divergence=[first_divergence(a, b) for a, b in zip(ref_greedy, continued, strict=True)],
                greedy_tokens=greedy,
            )
        )
    return out
