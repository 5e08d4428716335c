"""The pressure map: throughput, latency and KV memory over concurrency × context length.

A server that holds 16 clients at 256 tokens of context may hold 4 at 4,096: the knee of one
dimension moves with the other. Every cell of the grid is a closed-loop level of the sweep's own
client (`sweep.run_closed_level`) whose prompts are about that many tokens long: half a system part
every session of the cell shares (as agents send one long system prompt), half a distinct part of
each request's own. A cell whose sessions cannot hold their context in the server's KV cache at once
is marked so and not run.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ..client.exchange import timed_stream
from ..client.http import Client, ClientError
from .records import Level
from .sweep import SweepConfig, messages_for, one_request, run_closed_level

# Half of each prompt is the system part a cell's sessions share: docs/decisions.md, "The pressure map".
SHARED_SHARE = 0.5
MEASURED, DOES_NOT_FIT, NOT_RUN = "measured", "does not fit", "not run"
_SIZING_WORDS = 200  # the longer sizing prompt's extra words: enough for a steady tokens-per-word figure
_FALLBACK_TOKENS_PER_WORD = 1.5  # a server that reports no usage: a common English word's tokens


@dataclass(frozen=True)
class PromptSizer:
    """How many words a prompt of so many tokens takes: the server's tokenizer, read off two requests' usage."""

    overhead_tokens: float  # the template, the system prompt's fixed text and the request's opening
    tokens_per_word: float

    def words_for(self, tokens: int) -> int:
        return max(2, round((tokens - self.overhead_tokens) / self.tokens_per_word))

    def split(self, tokens: int) -> tuple[int, int]:
        """(shared system words, distinct words) for a prompt of about `tokens` tokens."""
        words = self.words_for(tokens)
        shared = round(words * SHARED_SHARE)
        return shared, max(1, words - shared)


def measure_sizer(client: Client, config: SweepConfig, seed: int) -> PromptSizer:
    """Two one-token requests, short and long, whose prompt tokens the server counts."""
    short, long = 8, 8 + _SIZING_WORDS
    counts = []
    for index, words in ((seed, short), (seed + 1, long)):
        sizing = replace(config, prompt_words=words, system_words=0, max_tokens=1, prompt=None, prompts=())
        timed = timed_stream(
            client,
            messages_for(sizing, index),
            max_tokens=1,
            temperature=0.0,
            origin="calibration · sizing prompts",
            **({"model": config.model} if config.model else {}),
        )
        counts.append(timed.counts.prompt)
    if not counts[0] or counts[1] <= counts[0]:  # no usage in the stream: a word's usual cost
        return PromptSizer(overhead_tokens=30.0, tokens_per_word=_FALLBACK_TOKENS_PER_WORD)
    per_word = (counts[1] - counts[0]) / _SIZING_WORDS
    return PromptSizer(overhead_tokens=counts[0] - short * per_word, tokens_per_word=per_word)


@dataclass(frozen=True)
class PressureCell:
    """One cell of the map: `concurrency` closed-loop sessions with prompts of `context_tokens`."""

    concurrency: int
    context_tokens: int
    state: str = MEASURED  # or DOES_NOT_FIT (why says why), NOT_RUN (the map was stopped first)
    why: str | None = None
    prompt_tokens_mean: float | None = None  # what the server counted: the context the cell really had
    shared_tokens: int | None = None  # about this many of them the sessions shared
    requests: int = 0
    errors: int = 0
    seconds: float | None = None
    output_tokens_per_s: float | None = None
    output_tokens_per_s_ci95: float | None = None
    requests_per_s: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p95_ms: float | None = None
    e2e_p50_ms: float | None = None
    e2e_p95_ms: float | None = None
    tpot_p50_ms: float | None = None
    kv_cells_peak: int | None = None  # the most KV cells in use at once (our server)
    kv_usage_max: float | None = None
    cached_share: float | None = None
    preemptions: int | None = None

    @classmethod
    def from_level(cls, level: Level, context: int, shared: int) -> PressureCell:
        return cls(
            concurrency=level.concurrency or 0,
            context_tokens=context,
            prompt_tokens_mean=level.prompt_tokens_mean,
            shared_tokens=shared,
            requests=level.requests,
            errors=level.errors,
            seconds=level.seconds,
            output_tokens_per_s=level.output_tokens_per_s,
            output_tokens_per_s_ci95=level.output_tokens_per_s_ci95,
            requests_per_s=level.requests_per_s,
            ttft_p50_ms=level.ttft_ms.p50,
            ttft_p95_ms=level.ttft_ms.p95,
            e2e_p50_ms=level.e2e_ms.p50,
            e2e_p95_ms=level.e2e_ms.p95,
            tpot_p50_ms=level.tpot_ms.p50,
            kv_cells_peak=level.kv_cells_max,
            kv_usage_max=level.kv_usage_max,
            cached_share=level.cached_share,
            preemptions=level.preemptions,
        )

    @property
    def measured(self) -> bool:
        return self.state == MEASURED and self.output_tokens_per_s is not None

    def meets(self, target_ms: float | None) -> bool | None:
        """Whether its p95 end-to-end latency is within the target (None: not measured, or no target)."""
        if not target_ms or not self.measured or self.e2e_p95_ms is None:
            return None
        return self.e2e_p95_ms <= target_ms


@dataclass(frozen=True)
class PressureMap:
    concurrency: tuple[int, ...]
    contexts: tuple[int, ...]
    max_tokens: int
    requests_per_cell: int
    latency_target_ms: float | None = None
    shared_share: float = SHARED_SHARE
    kv_cells_total: int | None = None  # the server's KV cache, when it says
    cells: tuple[PressureCell, ...] = ()
    stopped_because: str | None = None

    def cell(self, concurrency: int, context: int) -> PressureCell | None:
        return next((c for c in self.cells if c.concurrency == concurrency and c.context_tokens == context), None)

    def sessions_within_target(self, context: int) -> int | None:
        """The most sessions at `context` whose p95 end-to-end latency met the target (None: none did)."""
        met = [c.concurrency for c in self.cells if c.context_tokens == context and c.meets(self.latency_target_ms)]
        return max(met) if met else None

    def recommendation(self) -> list[str]:
        """What the map says, one line a context: the most sessions that meet the objective there."""
        target = self.latency_target_ms
        lines = []
        for context in self.contexts:
            row = [c for c in self.cells if c.context_tokens == context]
            measured = [c for c in row if c.measured]
            if not measured:
                why = "none fits the KV cache" if row and all(c.state == DOES_NOT_FIT for c in row) else "not run"
                lines.append(f"at {context:,} tokens of context: {why}")
                continue
            best = max(measured, key=lambda c: c.output_tokens_per_s or 0.0)
            peak = f"peak {best.output_tokens_per_s:.1f} tok/s with {sessions_text(best.concurrency)}"
            if not target:
                lines.append(f"at {context:,} tokens of context: {peak}")
                continue
            most = self.sessions_within_target(context)
            if most is None:
                lines.append(
                    f"at {context:,} tokens of context, no number of sessions tested meets p95 ≤ {_seconds(target)} "
                    f"({peak})"
                )
            else:
                verb = "meets" if most == 1 else "meet"
                lines.append(
                    f"at {context:,} tokens of context, at most {sessions_text(most)} {verb} p95 ≤ {_seconds(target)} "
                    f"({peak})"
                )
        return lines

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PressureMap:
        known = {f.name for f in fields(PressureCell)}
        cells = tuple(PressureCell(**{k: v for k, v in c.items() if k in known}) for c in data.get("cells") or ())
        top = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in top and k != "cells"}
        values["concurrency"] = tuple(values.get("concurrency") or ())
        values["contexts"] = tuple(values.get("contexts") or ())
        return cls(**values, cells=cells)

    def rows(self) -> list[dict[str, Any]]:
        """One row a cell (CSV, DataFrames), with whether it met the objective."""
        return [{**asdict(c), "meets_target": c.meets(self.latency_target_ms)} for c in self.cells]


def sessions_text(n: int) -> str:
    return f"{n} session{'' if n == 1 else 's'}"


def _seconds(ms: float) -> str:
    return f"{ms / 1000:g} s" if ms >= 1000 else f"{ms:g} ms"


def fit(concurrency: int, context: int, max_tokens: int, kv_cells: int | None) -> str | None:
    """Why `concurrency` sessions of `context` tokens cannot hold their context at once, or None when
    they can (or the server does not say its cache). The shared system part is held once."""
    if not kv_cells:
        return None
    one = context + max_tokens
    if one > kv_cells:
        return f"one session of {context:,} + {max_tokens:,} tokens is more than the {kv_cells:,} cells of the KV cache"
    shared = round(context * SHARED_SHARE)
    need = shared + concurrency * (one - shared)
    if need > kv_cells:
        return (
            f"{sessions_text(concurrency)} of {context:,} + {max_tokens:,} tokens ({shared:,} of them shared) need "
            f"{need:,} cells, more than the {kv_cells:,} of the KV cache"
        )
    return None


def _server_cells(client: Client) -> int | None:
    try:
        status = client.status()
    except ClientError:
        return None
    cells = status.get("kv_cells_total") if isinstance(status, dict) else None
    return int(cells) if cells else None


def run_pressure_map(
    client: Client,
    config: SweepConfig,
    contexts: tuple[int, ...],
    on_cell: Callable[[PressureCell], None] | None = None,
    stop: threading.Event | None = None,
) -> PressureMap:
    """Every cell of concurrency × context, shortest context first; the sweep's warm-up before."""
    config.validate()
    stop = stop or threading.Event()
    levels = tuple(sorted(set(config.concurrency)))
    for i in range(config.warmup_requests):
        if stop.is_set():
            break
        one_request(client, config, -1 - i, "calibration · warm-up")
    # Every run its own words (shared parts and distinct ones): a second map of the same server must
    # not find the first's prompts in its prefix cache.
    run_base = 1_000_000_000 * random.randrange(1, 1_000_000)
    sizer = measure_sizer(client, config, run_base)
    kv_cells = _server_cells(client)
    cells: list[PressureCell] = []
    stopped = None
    for row, context in enumerate(contexts):
        shared, distinct = sizer.split(context)
        cell_config = replace(
            config, prompt=None, prompts=(), system_words=shared, system_seed=run_base + row, prompt_words=distinct
        )
        shared_tokens = round(context * SHARED_SHARE)
        for column, concurrency in enumerate(levels):
            if stop.is_set():
                stopped = "stopped"
                cells.append(PressureCell(concurrency, context, NOT_RUN))
                continue
            why = fit(concurrency, context, config.max_tokens, kv_cells)
            if why is not None:
                cell = PressureCell(concurrency, context, DOES_NOT_FIT, why=why)
            else:
                offset = run_base + 1_000_000 * (row * len(levels) + column + 1)  # every cell its own prompts
                level = run_closed_level(client, cell_config, concurrency, stop, offset, label=f" · {context:,} tokens")
                if level.requests == 0:
                    stopped = "stopped"
                    cell = PressureCell(concurrency, context, NOT_RUN)
                else:
                    cell = PressureCell.from_level(level, context, shared_tokens)
            cells.append(cell)
            if on_cell is not None:
                on_cell(cell)
    return PressureMap(
        concurrency=levels,
        contexts=contexts,
        max_tokens=config.max_tokens,
        requests_per_cell=config.requests_per_level,
        latency_target_ms=config.latency_target_ms,
        kv_cells_total=kv_cells,
        cells=tuple(cells),
        stopped_because=stopped,
    )
