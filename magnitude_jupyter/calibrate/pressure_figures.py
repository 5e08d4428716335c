"""The pressure map's pictures, as plotly heatmaps: pure functions of maps (the widget, the report and
the archive's comparison draw the same ones)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import plotly.graph_objects as go

from .pressure import DOES_NOT_FIT, NOT_RUN, PressureCell, PressureMap

MISSES = "✗"  # a cell whose p95 end-to-end latency is over the target


def _axes(pmap: PressureMap) -> tuple[list[str], list[str]]:
    return [str(c) for c in pmap.concurrency], [f"{c:,}" for c in pmap.contexts]


def _grid(
    pmap: PressureMap, value: Callable[[PressureCell], float | None], label: Callable[[PressureCell], str]
) -> tuple[list[list[float | None]], list[list[str]]]:
    """z and text, a row a context (shortest first) and a column a concurrency; cells to come are empty."""
    z: list[list[float | None]] = []
    text: list[list[str]] = []
    for context in pmap.contexts:
        z_row: list[float | None] = []
        text_row: list[str] = []
        for concurrency in pmap.concurrency:
            cell = pmap.cell(concurrency, context)
            if cell is None:
                z_row.append(None)
                text_row.append("")
            elif not cell.measured:
                z_row.append(None)
                text_row.append(DOES_NOT_FIT if cell.state == DOES_NOT_FIT else NOT_RUN)
            else:
                z_row.append(value(cell))
                text_row.append(label(cell))
        z.append(z_row)
        text.append(text_row)
    return z, text


def _layout(title: str, pmap: PressureMap) -> dict[str, Any]:
    x, y = _axes(pmap)
    return {
        "title": {"text": title},
        "xaxis": {"title": "concurrent sessions", "type": "category", "categoryarray": x},
        "yaxis": {"title": "context per session (tokens)", "type": "category", "categoryarray": y},
        "height": 360,
        "margin": {"l": 80, "r": 20, "t": 80, "b": 50},
    }


def _heatmap(pmap: PressureMap, z: list[list[float | None]], text: list[list[str]], **style: Any) -> go.Heatmap:
    x, y = _axes(pmap)
    return go.Heatmap(x=x, y=y, z=z, text=text, texttemplate="%{text}", hoverongaps=False, **style)


def pressure_throughput_figure(pmap: PressureMap) -> go.Figure:
    z, text = _grid(pmap, lambda c: c.output_tokens_per_s, lambda c: f"{c.output_tokens_per_s:.1f}")
    fig = go.Figure(layout=_layout("Output tokens/s over concurrency × context", pmap))
    fig.add_trace(_heatmap(pmap, z, text, colorscale="Viridis", colorbar={"title": "tok/s"}))
    return fig


def pressure_latency_figure(pmap: PressureMap) -> go.Figure:
    target = pmap.latency_target_ms

    def label(cell: PressureCell) -> str:
        mark = f" {MISSES}" if cell.meets(target) is False else ""
        return f"{(cell.e2e_p95_ms or 0) / 1000:.2f} s{mark}"

    z, text = _grid(pmap, lambda c: c.e2e_p95_ms, label)
    title = "End-to-end p95 over concurrency × context"
    if target:
        title += f"<br><sup>{MISSES}: over the p95 target of {target / 1000:g} s</sup>"
    fig = go.Figure(layout=_layout(title, pmap))
    fig.add_trace(_heatmap(pmap, z, text, colorscale="YlOrRd", colorbar={"title": "ms"}))
    return fig


def pressure_difference_figure(now: PressureMap, then: PressureMap, then_name: str = "the baseline") -> go.Figure:
    """Tokens/s of `now` against `then`, cell by cell, in percent (cells only one measured are empty)."""

    def change(cell: PressureCell) -> float | None:
        old = then.cell(cell.concurrency, cell.context_tokens)
        if old is None or not old.measured or not old.output_tokens_per_s:
            return None
        return 100.0 * ((cell.output_tokens_per_s or 0.0) - old.output_tokens_per_s) / old.output_tokens_per_s

    def label(cell: PressureCell) -> str:
        value = change(cell)
        return "—" if value is None else f"{value:+.0f}%"

    z, text = _grid(now, change, label)
    title = f"Output tokens/s: this run against {then_name}<br><sup>blue: faster now; red: slower</sup>"
    fig = go.Figure(layout=_layout(title, now))
    fig.add_trace(_heatmap(now, z, text, colorscale="RdBu", zmid=0, colorbar={"title": "%"}))
    return fig


def pressure_figures(pmap: PressureMap) -> list[go.Figure]:
    return [pressure_throughput_figure(pmap), pressure_latency_figure(pmap)]
