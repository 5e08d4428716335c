"""Typed snapshots of the engine's state: the engine fills them, hosts decide how to show them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import psutil

from .metrics import StepCounts
from .plan import SchedulerStats
from .request import Request


@dataclass(frozen=True)
class LiveRequest:
    """A request waiting or running now."""

    id: str
    status: str
    priority: str
    prompt_tokens: int
    completion_tokens: int
    age_s: float
    origin: str | None = None  # where it came from: a notebook cell, a batch row, a calibration level, a user
    prompt_head: str | None = None  # the first words of what it asks (Request.prompt_head)

    @classmethod
    def of(cls, request: Request, now: float) -> LiveRequest:
        return cls(
            origin=request.origin or request.client,
            id=request.request_id,
            status="preempted" if request.preempted_time is not None else request.status.name.lower(),
            priority=request.priority.name.lower(),
            prompt_tokens=len(request.prompt_tokens),
            completion_tokens=len(request.output_tokens),
            age_s=round(now - request.arrival_time, 2),
            prompt_head=request.prompt_head,
        )


@dataclass(frozen=True)
class LoadWaiter:
    """A request waiting for its model to load, before any engine has it: the panel lists it."""

    id: str
    priority: str
    since: float  # time.monotonic() when it began to wait
    origin: str | None = None
    prompt_head: str | None = None

    @classmethod
    def since_then(
        cls, since: float, priority: str, origin: str | None = None, prompt_head: str | None = None
    ) -> LoadWaiter:
        """A waiter with an id of its own, waiting since `since`."""
        return cls(f"waiting-{uuid.uuid4().hex[:12]}", priority, since, origin, prompt_head)

    def live(self, now: float) -> LiveRequest:
        return LiveRequest(
            id=self.id,
            status="waiting for the model",
            priority=self.priority,
            prompt_tokens=0,
            completion_tokens=0,
            age_s=round(now - self.since, 2),
            origin=self.origin,
            prompt_head=self.prompt_head,
        )


@dataclass(frozen=True)
class FinishedRequest:
    """A request that ended, with the figures a person looks at first."""

    id: str
    finish_reason: str
    priority: str
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float | None
    total_ms: float | None
    origin: str | None = None
    prompt_head: str | None = None

    @classmethod
    def of(cls, request: Request) -> FinishedRequest:
        timings = request.timings()
        return cls(
            origin=request.origin or request.client,
            id=request.request_id,
            finish_reason=request.finish_reason.value if request.finish_reason else "unknown",
            priority=request.priority.name.lower(),
            prompt_tokens=len(request.prompt_tokens),
            completion_tokens=len(request.output_tokens),
            ttft_ms=round(timings.ttft_ms, 1) if timings.ttft_ms is not None else None,
            total_ms=round(timings.total_ms, 1) if timings.total_ms is not None else None,
            prompt_head=request.prompt_head,
        )


@dataclass(frozen=True)
class EngineStats:
    model: str
    state: str  # created, loading, ready, stopping, stopped or failed
    error: str | None
    parallel: int
    threads: int  # llama.cpp threads in use now
    trained_context: int | None
    scheduler: SchedulerStats
    kv_bytes_per_token: float | None  # what a cell of context costs (the global layers' alone, with windows)
    kv_buffer_bytes_reported: int | None
    kv_cache_type: str  # "f16", "q8_0", or "K/V" when they differ
    flash_attention: bool  # llama.cpp's attention kernel in the main context (EngineSettings.uses_flash_attention)
    flash_attention_reason: str | None  # set, or measured at load (attention_probe.py)
    flash_attention_source: str | None  # set | measured | remembered | default
    load_phase: str | None  # what a loading engine is doing now
    context_sizing: str | None  # how ctx_size auto was resolved
    rss_bytes: int
    recent_tokens_per_s: float
    generated_tokens_total: int
    uptime_s: float
    live: tuple[LiveRequest, ...]
    recent: tuple[FinishedRequest, ...]
    draft_tokens_total: int = 0  # prompt-lookup drafts decoded (speculate.py) ...
    draft_accepted_total: int = 0  # ... and confirmed
    drafts: dict[str, Any] | None = None  # what the draft policy measured (DraftPolicy.snapshot), if drafting
    steps: StepCounts | None = None  # where the engine thread's time went (metrics.StepCounts)
    default_max_tokens: int | None = None  # the cap of a request that gives none: `reserve` charges it
    kv_bytes_planned: int | None = None  # the KV cache the arithmetic plans (engine/memory.py)
    # the sliding-window layers' cache, when they keep windows: tokens seen, cells, bytes per token
    kv_window: dict[str, Any] | None = None


def rss_bytes() -> int:
    """This process's resident memory (calibration samples it)."""
    return int(psutil.Process().memory_info().rss)
