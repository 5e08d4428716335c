"""Counters and histograms the engine keeps about itself (the server renders them for Prometheus)."""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from .request import Request

LATENCY_BUCKETS_S = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def cumulative(self) -> list[tuple[float, int]]:
        out, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out


@dataclass(frozen=True)
class StepCounts:
    """The engine thread's work so far: llama_decode calls, the rows they computed (prompt rows among
    them), the seconds inside them, and the seconds of whole steps (plan, decode, sampling, events)."""

    decode_calls: int
    decode_rows: int
    decode_prompt_rows: int
    decode_seconds: float
    step_seconds: float
    compactions: int = 0  # KV cells moved to the front before a step (compaction.py)
    compaction_seconds: float = 0.0


@dataclass(frozen=True)
class Finished:
    """One finished request's latencies, for objectives over a rolling window (slo.py)."""

    at: float  # monotonic time it finished
    outcome: str  # stop, length, cancelled or error
    ttft_s: float | None
    e2e_s: float
    decode_tokens_per_s: float | None
    round: bool  # it continued a conversation (its messages held an earlier answer)
    prompt_s: float | None = None  # from admission to its first token: its prompt's share of TTFT


FINISHED_KEPT = 100_000  # finished requests remembered for rolling windows: memory stays bounded


class EngineMetrics:
    def __init__(self, window_seconds: float = 10.0) -> None:
        self._lock = threading.Lock()
        self.window_seconds = window_seconds
        self.requests_by_outcome: Counter[str] = Counter()
        # Per tenant (API key), where a server has several: requests by outcome, and tokens in and out.
        self.tenant_requests: Counter[tuple[str, str]] = Counter()
        self.tenant_tokens: Counter[tuple[str, str]] = Counter()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.draft_tokens_total = 0  # prompt-lookup draft tokens decoded (speculate.py) ...
        self.draft_accepted_total = 0  # ... and confirmed by the model's own picks
        # Where the engine thread's time goes: the llama_decode calls (and the rows they computed,
        # prompt rows apart: on CPU they cost a fraction of an answer row each), and whole steps, from
        # the plan to the step's events. Their difference is the engine's own cost per step.
        self.decode_calls_total = 0
        self.compactions_total = 0
        self.compaction_seconds_total = 0.0
        self.decode_rows_total = 0
        self.decode_prompt_rows_total = 0
        self.decode_seconds_total = 0.0
        self.step_seconds_total = 0.0
        self.ttft = Histogram()
        self.e2e = Histogram()
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens generated in that step)
        self.finished: deque[Finished] = deque(maxlen=FINISHED_KEPT)  # newest last
        self.started = time.monotonic()

    def record_step(self, generated_tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._recent.append((now, generated_tokens))
            self.generation_tokens_total += generated_tokens
            self._trim(now)

    def record_draft(self, drafted: int, accepted: int) -> None:
        with self._lock:
            self.draft_tokens_total += drafted
            self.draft_accepted_total += accepted

    def record_decode(self, rows: int, prompt_rows: int, seconds: float) -> None:
        with self._lock:
            self.decode_calls_total += 1
            self.decode_rows_total += rows
            self.decode_prompt_rows_total += prompt_rows
            self.decode_seconds_total += seconds

    def record_step_time(self, seconds: float) -> None:
        with self._lock:
            self.step_seconds_total += seconds

    def record_compaction(self, seconds: float, moved: bool) -> None:
        """A compaction's time (the check that found nothing to move counts too) and whether it moved cells."""
        with self._lock:
            self.compactions_total += moved
            self.compaction_seconds_total += seconds

    def tenant_counts(self) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]]:
        """(requests by (tenant, outcome), tokens by (tenant, kind)): a consistent copy."""
        with self._lock:
            return dict(self.tenant_requests), dict(self.tenant_tokens)

    def step_counts(self) -> StepCounts:
        with self._lock:
            return StepCounts(
                self.decode_calls_total,
                self.decode_rows_total,
                self.decode_prompt_rows_total,
                round(self.decode_seconds_total, 6),
                round(self.step_seconds_total, 6),
                self.compactions_total,
                round(self.compaction_seconds_total, 6),
            )

    def _trim(self, now: float) -> None:
        while self._recent and now - self._recent[0][0] > self.window_seconds:
            self._recent.popleft()

    def recent_tokens_per_s(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._trim(now)
            tokens = sum(n for _, n in self._recent)
        span = min(self.window_seconds, max(now - self.started, 1e-9))
        return tokens / span

    def record_finished(self, request: Request) -> None:
        with self._lock:
            outcome = request.finish_reason.value if request.finish_reason else "unknown"
            self.requests_by_outcome[outcome] += 1
            self.prompt_tokens_total += len(request.prompt_tokens)
            if request.tenant is not None:
                self.tenant_requests[(request.tenant, outcome)] += 1
                self.tenant_tokens[(request.tenant, "prompt")] += len(request.prompt_tokens)
                self.tenant_tokens[(request.tenant, "generated")] += len(request.output_tokens)
            if request.first_token_time is not None:
                self.ttft.observe(request.first_token_time - request.arrival_time)
            if request.finished_time is not None:
                self.e2e.observe(request.finished_time - request.arrival_time)
                first = request.first_token_time
                self.finished.append(
                    Finished(
                        at=request.finished_time,
                        outcome=outcome,
                        ttft_s=first - request.arrival_time if first is not None else None,
                        e2e_s=request.finished_time - request.arrival_time,
                        decode_tokens_per_s=request.timings().decode_tokens_per_s,
                        round=request.continues_conversation,
                        prompt_s=(
                            first - request.admitted_time
                            if first is not None and request.admitted_time is not None
                            else None
                        ),
                    )
                )

    def finished_since(self, since: float) -> list[Finished]:
        """The requests that finished at or after `since` (monotonic), oldest first."""
        with self._lock:
            out = []
            for item in reversed(self.finished):
                if item.at < since:
                    break
                out.append(item)
        return out[::-1]
