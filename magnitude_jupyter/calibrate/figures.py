"""The three calibration plots, as plotly figures: pure functions of profiles (the widget reuses them)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from .records import Level
from .stats import knee


def figure_bundle(figure: go.Figure) -> dict[str, Any]:
    """A figure as plain plotly output (its JSON, drawn responsive to its box): what a notebook keeps
    and a reloaded page redraws, without a FigureWidget's 5 MB of plotly.js in widget state."""
    spec = json.loads(figure.to_json())
    return {"application/vnd.plotly.v1+json": {**spec, "config": {"responsive": True}}, "text/plain": "<figure>"}


def concurrency_axis(levels: Sequence[int]) -> dict[str, Any]:
    """A log axis over the levels asked for, a tick on each: readable before the first point (an empty
    log axis spans 0.1 to 1M, with ticks like 65.53601k), and the same while the sweep fills it."""
    levels = sorted({int(c) for c in levels if c and c > 0}) or [1]
    return {
        "title": "concurrent clients",
        "type": "log",
        "tickvals": levels,
        "ticktext": [str(c) for c in levels],
        "range": [math.log10(levels[0]) - 0.15, math.log10(levels[-1]) + 0.15],
    }


def _profile_levels(profiles: list[Any]) -> list[int]:
    return [lv.concurrency for p in profiles for lv in p.levels if lv.concurrency]


def _closed(levels: list[Level]) -> list[Level]:
    return [lv for lv in levels if lv.concurrency]


def throughput_traces(levels: list[Level], name: str = "") -> dict[str, Any]:
    closed = _closed(levels)
    xs = [lv.concurrency for lv in closed]
    ys = [lv.output_tokens_per_s for lv in closed]
    k = knee([(float(x or 0), y) for x, y in zip(xs, ys, strict=True)])
    knee_y = [y for x, y in zip(xs, ys, strict=True) if x == k]
    err = [lv.output_tokens_per_s_ci95 or 0.0 for lv in closed]
    return {"x": xs, "y": ys, "err": err, "knee_x": [k] if k is not None else [], "knee_y": knee_y[:1], "name": name}


def throughput_title(config: dict[str, Any] | None) -> str:
    """The throughput plot's title, with what one point measured below it on two short lines."""
    if config is None:
        return "Output tokens/s vs concurrency"
    caption = measured_caption(config).replace("; prompt processing", ";<br>prompt processing")
    return f"Output tokens/s vs concurrency<br><sup>{caption}</sup>"


def measured_caption(config: dict[str, Any]) -> str:
    """What one point of a sweep is, in words: a learner comparing two numbers needs to know."""
    if config.get("prompt"):
        prompts = "one prompt for all (a prefix-cache hit after the first)"
    elif config.get("prompts"):
        prompts = f"{len(config['prompts'])} prompts of yours, cycled"
    else:
        prompts = f"distinct ~{config.get('prompt_words', 40)}-word prompts"
    seconds = f", at least {config['min_seconds_per_level']:g} s" if config.get("min_seconds_per_level") else ""
    return (
        f"each point: {config.get('requests_per_level')} requests{seconds}, {config.get('max_tokens')} new tokens "
        f"each, {prompts}; prompt processing included; bars: 95% interval"
    )


def latency_traces(levels: list[Level], key: str = "ttft_ms") -> dict[str, list[Any]]:
    closed = _closed(levels)
    out: dict[str, list[Any]] = {"x": [lv.concurrency for lv in closed]}
    for stat in ("p50", "p95", "p99"):
        out[stat] = [getattr(getattr(lv, key), stat) for lv in closed]
    return out


def throughput_figure(profiles: list[Any]) -> go.Figure:
    fig = go.Figure(
        layout={
            "title": {"text": throughput_title(profiles[0].config if profiles else None)},
            "xaxis": concurrency_axis(_profile_levels(profiles)),
            "yaxis": {"title": "output tok/s", "rangemode": "tozero"},
        }
    )
    for profile in profiles:
        t = throughput_traces(profile.levels, profile.name or str(profile.model.get("id")))
        error = {"type": "data", "array": t["err"], "visible": True}
        fig.add_scatter(x=t["x"], y=t["y"], error_y=error, mode="lines+markers", name=t["name"])
        fig.add_scatter(
            x=t["knee_x"], y=t["knee_y"], mode="markers", name="knee", marker={"size": 14, "symbol": "star"}
        )
    return fig


def latency_figure(profiles: list[Any], key: str = "ttft_ms", target_ms: float | None = None) -> go.Figure:
    fig = go.Figure(
        layout={
            "title": f"{key.split('_')[0].upper()} percentiles vs concurrency",
            "xaxis": concurrency_axis(_profile_levels(profiles)),
            "yaxis": {"title": "ms", "rangemode": "tozero"},
        }
    )
    for profile in profiles:
        t = latency_traces(profile.levels, key)
        for stat in ("p50", "p95", "p99"):
            fig.add_scatter(
                x=t["x"],
                y=t[stat],
                mode="lines+markers",
                name=f"{profile.name} {stat}".strip(),
                **PERCENTILE_STYLE[stat],
            )
    if target_ms and key == "e2e_ms":  # the latency target is an end-to-end p95: drawn where e2e is
        fig.add_hline(y=target_ms, line_dash="dash", annotation_text="p95 target")
    return fig


# p95 drawn thickest and p99 dotted on top of it: where the two coincide both stay visible.
PERCENTILE_STYLE: dict[str, dict[str, Any]] = {
    "p50": {"line": {"width": 2}},
    "p95": {"line": {"width": 4}},
    "p99": {"line": {"width": 1.5, "dash": "dot"}, "marker": {"size": 5}},
}
FIT = "fit the memory budget"
ADMITTED = "run at once"


def capacity_traces(capacity: dict[str, Any] | None) -> dict[str, Any]:
    if not capacity:
        return {
            **{key: [] for key in ("x", "y", "admitted_y", "current_x", "current_y", "probe_x", "probe_y")},
            "name": FIT,
            "admitted_name": ADMITTED,
        }
    table = capacity.get("table") or []
    current = capacity.get("current") or {}
    probe = capacity.get("probe") or {}
    return {
        "x": [row["context"] for row in table],
        "y": [row["sessions"] for row in table],
        # With a turn's answer charged on top of its context (admission): the sessions that run at once.
        "admitted_y": [row["sessions_admitted"] for row in table if "sessions_admitted" in row],
        "admitted_name": f"{ADMITTED} (admission: {capacity.get('admission')}, a turn charged its context + "
        f"{capacity.get('turn_charge_tokens') or 0:,} tokens)",
        "current_x": [current["context_per_session"]] if current else [],
        "current_y": [current["parallel"]] if current else [],
        "probe_x": [probe["context_per_session"]] if probe.get("context_per_session") else [],
        "probe_y": [probe.get("sessions_running_at_once")] if probe.get("context_per_session") else [],
        # Which cache the curve is for: a q8_0 cache holds about twice what an f16 one does.
        "name": f"{FIT} ({capacity.get('cache_type', 'f16')} KV cache, "
        f"{capacity.get('bytes_per_token', 0):,.0f} B/token)",
    }


def capacity_title(capacity: dict[str, Any] | None) -> str:
    """The capacity plot's title, with what its lines are in words below it."""
    title = "Sessions that fit vs context per session (KV cache)"
    if not capacity:
        return title
    budget = capacity.get("memory_budget_bytes") or 0
    caption = (
        f"line: sessions of each length whose KV cache fits the {budget / 2**30:.1f} GiB free now; "
        "<br>diamond: the engine's setting (parallel, and the context each gets), sized by its ctx_size, not by memory"
    )
    return f"{title}<br><sup>{caption}</sup>"


def capacity_figure(profile: Any) -> go.Figure:
    t = capacity_traces(profile.capacity)
    fig = go.Figure(
        layout={
            "title": capacity_title(profile.capacity),
            "xaxis": {"title": "context per session (tokens)", "type": "log"},
            "yaxis": {"title": "sessions", "type": "log"},
        }
    )
    fig.add_scatter(x=t["x"], y=t["y"], mode="lines+markers", name=t["name"])
    fig.add_scatter(
        x=t["current_x"],
        y=t["current_y"],
        mode="markers",
        name="engine setting",
        marker={"size": 14, "symbol": "diamond"},
    )
    fig.add_scatter(
        x=t["probe_x"], y=t["probe_y"], mode="markers", name="probe: ran at once", marker={"size": 10, "symbol": "x"}
    )
    admitted_x = t["x"][: len(t["admitted_y"])]
    fig.add_scatter(x=admitted_x, y=t["admitted_y"], mode="lines", name=t["admitted_name"], line={"dash": "dot"})
    return fig


def workflow_figure(result: Any) -> go.Figure:
    """p95 round latency against the round, one line per number of sessions, with the SLO."""
    fig = go.Figure(
        layout={
            "title": "Round latency (p95) by round, per number of concurrent sessions",
            "xaxis": {"title": "round", "dtick": 1},
            "yaxis": {"title": "p95 round latency, ms"},
        }
    )
    for level in result.levels:
        fig.add_scatter(
            x=[r.round for r in level.rounds],
            y=[r.e2e_ms.p95 for r in level.rounds],
            mode="lines+markers",
            name=f"{level.sessions} session{'' if level.sessions == 1 else 's'}"
            + ("" if level.meets_slo else " (misses the SLO)"),
        )
    fig.add_hline(y=result.slo_round_p95_ms, line_dash="dash", annotation_text="SLO")
    return fig
