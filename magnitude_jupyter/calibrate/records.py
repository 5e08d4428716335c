"""What a calibration measures, as typed records: one `Level` per concurrency (or arrival rate), and the
profile's `Summary`. They travel as plain JSON (`to_json` / `from_json`) in the profile files."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class Percentiles:
    """A latency's distribution in milliseconds; every figure None when nothing was measured."""

    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    mean: float | None = None
    std: float | None = None


LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "queue_ms")


@dataclass(frozen=True)
class Level:
    """One level of a sweep: closed-loop clients (`concurrency`) or open-loop arrivals (`arrival_rate`)."""

    requests: int
    errors: int
    seconds: float
    requests_per_s: float
    output_tokens: int
    output_tokens_per_s: float
    ttft_ms: Percentiles = field(default_factory=Percentiles)  # arrival to first token, queue included
    tpot_ms: Percentiles = field(default_factory=Percentiles)  # per output token after the first
    itl_ms: Percentiles = field(default_factory=Percentiles)  # gaps between streamed pieces
    e2e_ms: Percentiles = field(default_factory=Percentiles)
    queue_ms: Percentiles = field(default_factory=Percentiles)  # from our server's timings only
    concurrency: int | None = None
    arrival_rate: float | None = None
    # Sampled from our server's /status during the level; None from any other server.
    kv_usage_max: float | None = None
    kv_usage_mean: float | None = None
    kv_cells_max: int | None = None  # the most KV cells in use at once
    rss_bytes_max: int | None = None
    waiting_max: int | None = None
    prompt_tokens_mean: float | None = None  # as the server counted them (None: it did not say)
    cached_share: float | None = None  # prompt tokens the server took from its prefix cache / all prompt tokens
    preemptions: int | None = None  # running requests our server preempted for cells during the level
    # Half-width of a 95% interval around output_tokens_per_s (closed loop: see sweep.throughput_interval).
    output_tokens_per_s_ci95: float | None = None

    @property
    def step(self) -> float | None:
        """What the level varied: its concurrency, or its arrival rate."""
        return self.concurrency if self.concurrency is not None else self.arrival_rate

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Level:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        for key in LATENCIES:
            values[key] = Percentiles(**(data.get(key) or {}))
        return cls(**values)

    def flat(self) -> dict[str, Any]:
        """One row: the latencies spread into columns such as `ttft_ms_p95` (CSV, DataFrames)."""
        row = {"concurrency": self.concurrency, "arrival_rate": self.arrival_rate}
        row |= {k: v for k, v in self.to_json().items() if k not in LATENCIES and k not in row}
        for key in LATENCIES:
            for stat, value in asdict(getattr(self, key)).items():
                row[f"{key}_{stat}"] = value
        return row


@dataclass(frozen=True)
class Summary:
    single_stream_tokens_per_s: float | None = None
    peak_tokens_per_s: float | None = None
    peak_concurrency: int | None = None
    knee_concurrency: int | None = None  # beyond it, doubling the clients gains less than 10%
    knee_not_reached: bool = False  # still gaining 10% per doubling at the largest level tested
    scaling_efficiency: dict[str, float | None] = field(default_factory=dict)  # thr(c) / (c * thr(1)), by c
    e2e_std_ms_at_knee: float | None = None
    ttft_std_ms_at_knee: float | None = None
    usable_context_ratio: float | None = None  # ctx size / trained context
    latency_target_ms: float | None = None
    recommended_parallel: int | None = None  # the highest-throughput concurrency within the target

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Summary:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
