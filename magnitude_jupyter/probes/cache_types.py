"""The capacity trade, calibrated: one engine per KV cache type, the same sweep on each.

A quantized KV cache holds more sessions × context in the same memory; what it costs in speed is
measured here (its accuracy in `kv_quality.py`). The engines are ours, started in this process one
after the other with nothing changed but the cache type, so the profiles differ only by it. One
figure puts the capacity curve of every type beside its throughput.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..batch.inprocess import EngineClient
from ..calibrate.profile import Profile
from ..calibrate.records import Level
from ..calibrate.run import calibrate
from ..calibrate.sweep import SweepConfig
from ..config import load_settings
from ..engine import Engine


def calibrate_cache_types(
    cache_types: Sequence[str],
    config: SweepConfig,
    model: str | None = None,
    on_level: Callable[[str, Level], None] | None = None,
    memory_bytes: int | None = None,
    **engine_settings: Any,
) -> list[Profile]:
    """A profile per cache type, each from a fresh engine (`parallel` the largest level unless given)."""
    settings = load_settings()
    engine_settings.setdefault("parallel", max(config.concurrency))
    profiles = []
    for cache_type in cache_types:
        with Engine(model, settings=settings, cache_type=cache_type, cache_type_v=None, **engine_settings) as engine:
            client = cast(Any, EngineClient(engine, source=f"{cache_type} KV cache"))
            report = functools.partial(on_level, cache_type) if on_level else None
            profiles.append(
                calibrate(client, config, False, memory_bytes, on_level=report, name=f"{cache_type} KV cache")
            )
    return profiles


def cache_type_rows(profiles: Sequence[Profile]) -> list[dict[str, Any]]:
    """One row per type: what the cache holds and what the engine sustained with it."""
    rows = []
    base = profiles[0].summary.peak_tokens_per_s if profiles else None
    for p in profiles:
        cap = p.capacity or {}
        peak = p.summary.peak_tokens_per_s
        trained = p.model.get("trained_context") or 0
        fit = cap.get("tokens_that_fit")
        rows.append(
            {
                "cache_type": cap.get("cache_type"),
                "bytes_per_token": cap.get("bytes_per_token"),
                "tokens_that_fit": fit,
                "sessions_at_trained_context": fit // trained if fit and trained else None,
                "single_stream_tok_s": p.summary.single_stream_tokens_per_s,
                "peak_tok_s": peak,
                "peak_vs_first": round(peak / base, 3) if peak and base else None,
            }
        )
    return rows


def format_cache_types(profiles: Sequence[Profile]) -> str:
    head = "cache    bytes/token   tokens in memory   sessions at trained ctx   1 stream tok/s   peak tok/s   vs first"
    lines = [head]
    for r in cache_type_rows(profiles):
        lines.append(
            f"{r['cache_type'] or '-':<8} {r['bytes_per_token'] or 0:>11,.0f}   {r['tokens_that_fit'] or 0:>16,}   "
            f"{r['sessions_at_trained_context'] or 0:>23,}   {r['single_stream_tok_s'] or 0:>14.1f}   "
            f"{r['peak_tok_s'] or 0:>10.1f}   {r['peak_vs_first'] or 0:>8.2f}"
        )
    return "\n".join(lines)


def cache_types_figure(profiles: Sequence[Profile]) -> go.Figure:
    """Left: sessions that fit against context per session, a line per type. Right: output tok/s
    against concurrency, a line per type."""
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=("Sessions that fit vs context per session", "Output tokens/s vs concurrent clients"),
    )
    for p in profiles:
        cap = p.capacity or {}
        table = cap.get("table") or []
        name = f"{cap.get('cache_type', '?')} ({cap.get('bytes_per_token', 0):,.0f} B/token)"
        fig.add_scatter(
            x=[row["context"] for row in table],
            y=[row["sessions"] for row in table],
            mode="lines+markers",
            name=name,
            legendgroup=name,
            row=1,
            col=1,
        )
        fig.add_scatter(
            x=[lv.concurrency for lv in p.levels],
            y=[lv.output_tokens_per_s for lv in p.levels],
            mode="lines+markers",
            name=name,
            legendgroup=name,
            showlegend=False,
            row=1,
            col=2,
        )
    fig.update_xaxes(title_text="context per session (tokens)", type="log", row=1, col=1)
    fig.update_yaxes(title_text="sessions", type="log", row=1, col=1)
    fig.update_xaxes(title_text="concurrent clients", type="log", row=1, col=2)
    fig.update_yaxes(title_text="output tokens/s", row=1, col=2)
    fig.update_layout(title="The KV cache type: capacity gained, speed kept or lost", autosize=True)
    return fig
