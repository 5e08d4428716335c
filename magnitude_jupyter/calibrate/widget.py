"""The calibration widget: controls, three live plotly figures, a progress bar and a Stop button.

With context lengths given, Start measures the pressure map instead (concurrency × context), its
two heatmaps filled in cell by cell.

The sweep runs on a background thread, so the Stop button (and the rest of the notebook) stays
live; each finished level updates the figures (`batch_update`) and draws them again. Several models picked
are swept one after the other, each with a line of its own on the throughput and TTFT plots. Earlier
runs stay on the plots, greyed (a profile measured in a cell above can be the first of them), and the
verdict says, level by level, whether the runs agree within their 95% intervals.
"""

from __future__ import annotations

import html
import threading
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import ipywidgets as w
import plotly.graph_objects as go

from ..client.http import Client, discover
from .figures import (
    PERCENTILE_STYLE,
    capacity_figure,
    capacity_title,
    capacity_traces,
    concurrency_axis,
    figure_bundle,
    latency_figure,
    latency_traces,
    throughput_title,
    throughput_traces,
)
from .options import parse_contexts, parse_levels
from .pressure import PressureCell, PressureMap
from .pressure_figures import pressure_latency_figure, pressure_throughput_figure
from .profile import Profile
from .records import Level
from .report import agreement_text, knee_text
from .run import calibrate, calibrate_pressure_map
from .sweep import SweepConfig

SERVER_DEFAULT = "(server default)"
EARLIER = {"color": "rgba(140, 140, 140, 0.55)"}  # an earlier run's lines
WIDE = {"description_width": "initial"}  # a control's whole label, never cut


class CalibrationWidget:
    @classmethod
    def connect(
        cls,
        client: Client | None = None,
        config: SweepConfig | None = None,
        probe: bool = True,
        earlier: Profile | None = None,
        contexts: str = "",
    ) -> CalibrationWidget:
        """The widget for a server (`client`, else the one discovered), offering the models it serves."""
        client = client or discover()
        models = [m["id"] for m in client.models() if m.get("error") is None]
        return cls(client, models, config, probe, earlier, contexts)

    def __init__(
        self,
        client: Client,
        models: list[str],
        config: SweepConfig | None = None,
        probe: bool = True,
        earlier: Profile | None = None,
        contexts: str = "",
    ) -> None:
        """`models`: those the server serves (none: its default); `earlier`: a profile measured
        before (a cell above), drawn greyed as the first run; `contexts`: context lengths for a
        pressure map (empty: a plain sweep). Sends nothing: `connect` asks the server."""
        self.client = client
        config = config or SweepConfig()
        self._base_config = config
        self.run_probe = probe
        self.profile: Profile | None = None
        self.profiles: list[Profile] = []  # one per model swept, in order
        self.error: str | None = None
        self.levels: list[Level] = []
        self.pressure_map: PressureMap | None = None  # the last map measured (or being measured)
        self._first_levels: list[Level] = []  # this run's levels of the first model: kept greyed by the next run
        self._earlier: list[tuple[str, list[Level]]] = [("the cell's run", earlier.levels)] if earlier else []
        # each earlier run's knee, in words (the verdict names both when they differ)
        self._earlier_knees: list[str] = [knee_text(earlier.summary)] if earlier else []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._make_controls(config, models, contexts)
        self._make_figures(config)
        self.box = w.VBox([self._controls_box(), self.map_box, self.sweep_plots], layout=w.Layout(width="100%"))
        self._reset_traces(self.models())  # an earlier profile's lines, greyed, from the start
        if earlier is not None:
            self.verdict.value = (
                f"The cell's run: {knee_text(earlier.summary)}. Press Start to measure again beside it."
            )
        self._draw(self.capacity)

    def _make_controls(self, config: SweepConfig, models: list[str], contexts: str) -> None:
        self.model = w.SelectMultiple(
            options=models or [SERVER_DEFAULT],
            value=(models[0] if models else SERVER_DEFAULT,),
            rows=min(4, max(1, len(models))),
            description="models",
        )
        self._line = 0  # the throughput trace of the model being swept
        self.concurrency = w.Text(",".join(map(str, config.concurrency)), description="concurrency", style=WIDE)
        self.requests = w.BoundedIntText(
            config.requests_per_level, min=1, max=10_000, description="requests/level", style=WIDE
        )
        self.max_tokens = w.BoundedIntText(config.max_tokens, min=1, max=32_768, description="max tokens", style=WIDE)
        self.prompt = w.Textarea(
            config.prompt or "",
            description="prompt",
            placeholder="(empty: a distinct prompt for every request)",
            style=WIDE,
        )
        self.target = w.FloatText(config.latency_target_ms or 0.0, description="p95 target ms", style=WIDE)
        self.contexts = w.Text(
            contexts,
            description="pressure map: contexts",
            placeholder="(empty: one sweep over concurrency)",
            style=WIDE,
        )
        self.start_button = w.Button(description="Start", button_style="primary", icon="play")
        self.stop_button = w.Button(description="Stop", button_style="warning", icon="stop", disabled=True)
        self.progress = w.IntProgress(value=0, min=0, max=len(config.concurrency), description="levels")
        self.status = w.Label("ready", layout=w.Layout(width="auto"))
        # The verdict, in sentences that wrap: the knee, and how this run compares with the earlier ones.
        self.verdict = w.HTML("", layout=w.Layout(width="100%"))
        # What the run recommends, into the config: the diff first, then a second button writes it.
        self.apply_button = w.Button(description="Apply to config…", icon="file", disabled=True)
        self.write_button = w.Button(description="Write it", button_style="danger", icon="check", disabled=True)
        self.apply_text = w.HTML("", layout=w.Layout(width="100%"))
        self._pending_config: tuple[Path, str] | None = None
        self.apply_button.on_click(lambda _: self.propose())
        self.write_button.on_click(lambda _: self.write())
        self.start_button.on_click(lambda _: self.start())
        self.stop_button.on_click(lambda _: self.stop())

    def _make_figures(self, config: SweepConfig) -> None:
        # No fixed widths: each plot takes the width of its box, side by side in a wide cell, stacked
        # in a narrow one (two 700 px plots overflow a notebook cell beside the Lab panel).
        self.throughput = go.Figure(
            layout={
                "title": "Output tokens/s vs concurrency",
                "height": 360,
                "autosize": True,
                "margin": {"l": 60, "r": 20, "t": 90, "b": 50},  # room for the two-line caption
                "xaxis": concurrency_axis(config.concurrency),
                "yaxis": {"title": "tok/s", "rangemode": "tozero"},
                "legend": {"orientation": "h", "y": -0.25},
            }
        )
        self.throughput.add_scatter(x=[], y=[], mode="lines+markers", name="output tok/s")
        self.throughput.add_scatter(x=[], y=[], mode="markers", name="knee", marker={"size": 14, "symbol": "star"})
        self.latency = go.Figure(latency_figure([]))
        self.latency.update_layout(
            height=320,
            autosize=True,
            margin={"l": 60, "r": 20, "t": 50, "b": 50},
            xaxis=concurrency_axis(config.concurrency),
            legend={"orientation": "h", "y": -0.25},
        )
        for stat in ("p50", "p95", "p99"):
            self.latency.add_scatter(x=[], y=[], mode="lines+markers", name=f"TTFT {stat}", **PERCENTILE_STYLE[stat])
        self.capacity = go.Figure(capacity_figure(_Empty()))
        self.capacity.update_layout(height=320, autosize=True, margin={"l": 60, "r": 20, "t": 50, "b": 50})
        self._views = {id(fig): _view() for fig in (self.throughput, self.latency, self.capacity)}
        plots = w.Box(
            [self._views[id(self.throughput)], self._views[id(self.latency)]],
            layout=w.Layout(display="flex", flex_flow="row wrap", width="100%"),
        )
        self.sweep_plots = w.VBox([plots, self._views[id(self.capacity)]], layout=w.Layout(width="100%"))
        # The pressure map's two heatmaps: shown once a map is asked for.
        self.map_views = (_view(), _view())
        self.map_box = w.Box(list(self.map_views), layout=w.Layout(display="none", flex_flow="row wrap", width="100%"))

    def _controls_box(self) -> w.VBox:
        return w.VBox(
            [
                w.HBox([self.model, self.concurrency, self.requests]),
                w.HBox([self.max_tokens, self.target, self.contexts]),
                self.prompt,
                w.HBox([self.start_button, self.stop_button, self.progress, self.status]),
                self.verdict,
                w.HBox([self.apply_button, self.write_button]),
                self.apply_text,
            ]
        )

    def _draw(self, *figures: go.Figure) -> None:
        """Show each figure as it is now, as plain plotly output inside an Output widget.

        Not a FigureWidget: each of those carries plotly.js (about 5 MB) in its widget state, and a
        reloaded page has about 2 s to fetch every widget's state from the kernel before it gives
        up with "model not found" for all of them; three figures missed it. An Output widget's
        state is the figure's JSON, and the page redraws it from there (sized to its box)."""
        for figure in figures:
            bundle = figure_bundle(figure)
            self._views[id(figure)].outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.box)

    # -- running ------------------------------------------------------------------------------

    def config(self) -> SweepConfig:
        """The sweep the controls describe, over what the widget was made with (warm-up, prompts, …)."""
        return replace(
            self._base_config,
            concurrency=parse_levels(self.concurrency.value),
            requests_per_level=int(self.requests.value),
            max_tokens=int(self.max_tokens.value),
            prompt=self.prompt.value.strip() or None,
            latency_target_ms=float(self.target.value) or None,
        )

    def models(self) -> list[str | None]:
        picked = [m for m in self.model.value if m != SERVER_DEFAULT]
        return list(picked) or [None]

    def start(self) -> None:
        """Run the sweep on a background thread (the widget's Start button)."""
        if self.running():
            return
        self._thread = threading.Thread(target=self.run, daemon=True, name="magnitude-calibrate")
        self._thread.start()

    def running(self) -> bool:
        """Whether a sweep (or a map) started by Start is still going."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """End the sweep after the requests in flight; what was measured is kept."""
        self._stop.set()
        self.status.value = "stopping after the requests in flight…"

    def wait(self, timeout: float | None = None) -> Profile | None:
        if self._thread is not None:
            self._thread.join(timeout)
        return self.profile

    def run(self) -> Profile | None:
        """Run the sweep (or the pressure map) in this thread, updating the widget as it goes."""
        try:
            config = self.config()
            contexts = parse_contexts(self.contexts.value) if self.contexts.value.strip() else ()
        except ValueError as exc:
            self.error = self.status.value = str(exc)
            return None
        if contexts:
            return self.run_map(config, contexts)
        models = self.models()
        self._stop.clear()
        if self._first_levels:  # the last run stays on the plots, greyed
            self._earlier.append((f"run {len(self._earlier) + 1}", self._first_levels))
            if self.profiles:
                self._earlier_knees.append(knee_text(self.profiles[0].summary))
        self.levels, self._first_levels = [], []
        self.profiles = []
        self.error = None
        self.progress.max, self.progress.value = len(config.concurrency) * len(models), 0
        self.progress.description = "levels"
        self.sweep_plots.layout.display = "flex"
        self._reset_traces(models)
        self.start_button.disabled, self.stop_button.disabled = True, False
        self.apply_button.disabled = self.write_button.disabled = True
        self.apply_text.value, self._pending_config = "", None
        self.status.value = "measuring capacity…" if self.run_probe else "warming up…"
        self.latency.layout.shapes = ()  # (the p95 target is end-to-end: not drawn on the TTFT plot)
        try:
            for index, model in enumerate(models):
                if self._stop.is_set():
                    break
                self._line, self.levels = index, []
                client = self._client_for(model)
                self.profile = calibrate(
                    client,
                    replace(config, model=client.model),
                    run_probe=self.run_probe and index == 0,
                    on_level=self._on_level,
                    on_capacity=self._on_capacity,
                    stop=self._stop,
                )
                self.profiles.append(self.profile)
            assert self.profile is not None
            why = self.profile.stopped_because
            done = sum(len(p.levels) for p in self.profiles)
            self.status.value = f"done: {done} levels" + (f" ({why})" if why else "")
            self.verdict.value = self._verdict()
            self.apply_button.disabled = not self.profiles
        except Exception as exc:  # shown in the widget: the sweep runs on a thread with no traceback to see
            self.error = self.status.value = f"failed: {exc}"
        finally:
            self.start_button.disabled, self.stop_button.disabled = False, True
        return self.profile

    def run_map(self, config: SweepConfig, contexts: tuple[int, ...]) -> Profile | None:
        """The pressure map of the first model picked, each cell drawn as it ends."""
        self._stop.clear()
        self.error = None
        levels = tuple(sorted(set(config.concurrency)))
        self.pressure_map = PressureMap(
            levels, contexts, config.max_tokens, config.requests_per_level, config.latency_target_ms
        )
        self.progress.max, self.progress.value = len(levels) * len(contexts), 0
        self.progress.description = "cells"
        self.map_box.layout.display, self.sweep_plots.layout.display = "flex", "none"  # what this run draws
        self._draw_map()
        self.start_button.disabled, self.stop_button.disabled = True, False
        self.verdict.value = ""
        try:
            client = self._client_for(self.models()[0])
            self.status.value = "warming up, then sizing the prompts…"
            profile = calibrate_pressure_map(
                client, replace(config, model=client.model), contexts, on_cell=self._on_cell, stop=self._stop
            )
            self.profile, self.pressure_map = profile, profile.pressure_map
            self._draw_map()
            assert self.pressure_map is not None
            done = sum(c.measured for c in self.pressure_map.cells)
            why = self.pressure_map.stopped_because
            self.status.value = f"done: {done} cells measured" + (f" ({why})" if why else "")
            lines = "".join(f"<li>{html.escape(line)}</li>" for line in self.pressure_map.recommendation())
            self.verdict.value = f"The pressure map: <ul>{lines}</ul>"
        except Exception as exc:  # shown in the widget: the map runs on a thread with no traceback to see
            self.error = self.status.value = f"failed: {exc}"
        finally:
            self.start_button.disabled, self.stop_button.disabled = False, True
        return self.profile

    def _on_cell(self, cell: PressureCell) -> None:
        assert self.pressure_map is not None
        self.pressure_map = replace(self.pressure_map, cells=(*self.pressure_map.cells, cell))
        self.progress.value = len(self.pressure_map.cells)
        what = (
            f"{cell.output_tokens_per_s:.1f} tok/s, p95 {(cell.e2e_p95_ms or 0) / 1000:.2f} s"
            if cell.measured
            else cell.state
        )
        self.status.value = f"{cell.concurrency} × {cell.context_tokens:,} tokens: {what}"
        self._draw_map()

    def _draw_map(self) -> None:
        if self.pressure_map is None:
            return
        figures = (pressure_throughput_figure(self.pressure_map), pressure_latency_figure(self.pressure_map))
        for view, figure in zip(self.map_views, figures, strict=True):
            figure.update_layout(autosize=True)
            view.outputs = ({"output_type": "display_data", "data": figure_bundle(figure), "metadata": {}},)

    def propose(self, path: Path | None = None) -> str:
        """Show what applying the last run would change in the config file (its diff); the Write
        button then writes it. Returns the diff (empty: nothing to write, and the text says why)."""
        from ..config import config_path
        from .apply import proposal

        if not self.profiles:
            return ""
        path = path or config_path()
        what, diff, new = proposal(self.profiles[0], path)
        self._pending_config = (path, new) if diff else None
        self.write_button.disabled = not diff
        body = f"<pre>{html.escape(diff)}</pre>" if diff else ""
        self.apply_text.value = f"{html.escape(what)}{body}"
        return diff

    def write(self) -> Path | None:
        """Write the changes `propose` showed; the server runs with them from its next start."""
        from .apply import write_config

        if self._pending_config is None:
            return None
        path, text = self._pending_config
        write_config(path, text)
        self._pending_config = None
        self.write_button.disabled = True
        self.apply_text.value = f"wrote {html.escape(str(path))}: restart the server (or JupyterLab) to run with it"
        return path

    def _verdict(self) -> str:
        """The knee, and whether this run agrees with the last earlier one, in sentences."""
        if not self._first_levels:
            return "Stopped before a level finished: nothing was measured."
        assert self.profiles
        knee = knee_text(self.profiles[0].summary)
        text = f"This run: {knee}."
        if self._earlier:
            name, levels = self._earlier[-1]
            then = self._earlier_knees[-1] if len(self._earlier_knees) == len(self._earlier) else None
            if then is not None and then != knee:  # one knee a run: the page says which is which
                text += f" {name[0].upper()}{name[1:]}: {then}."
            agreement = agreement_text(levels, self._first_levels, name)
            if agreement:
                text += f" {agreement}"
        return text

    def _client_for(self, model: str | None) -> Client:
        """The client on `model`; a magnitude server loads it first, so the sweep does not time a load."""
        if model is None:
            return self.client
        self.status.value = f"loading {model}…"
        if self.client.is_magnitude():
            model = self.client.load_model(model)["id"]
        return self.client.for_model(model)

    def _reset_traces(self, models: list[str | None]) -> None:
        """Line 0 (and the knee, trace 1) for the first model, then one throughput line and one TTFT
        p95 line for each further model."""
        names = [m or "output tok/s" for m in models]
        try:
            config = self.config()
        except ValueError:
            config = None
        if config is not None:  # the levels asked for, and what one point measures
            self.throughput.layout.title = {"text": throughput_title(asdict(config))}
            for fig in (self.throughput, self.latency):
                fig.update_xaxes(**concurrency_axis(config.concurrency))
        with self.throughput.batch_update():
            self.throughput.data = self.throughput.data[:2]
            self.throughput.data[0].name = names[0]
            for trace in self.throughput.data:
                trace.x, trace.y = [], []
            for name in names[1:]:
                self.throughput.add_scatter(x=[], y=[], mode="lines+markers", name=name)
            for name, levels in self._earlier:  # after this run's traces, whose places stay fixed
                t = throughput_traces(levels)
                self.throughput.add_scatter(
                    x=t["x"],
                    y=t["y"],
                    error_y={"type": "data", "array": t["err"], "visible": True, "color": EARLIER["color"]},
                    mode="lines+markers",
                    name=f"{name} (earlier)",
                    line=EARLIER,
                    marker=EARLIER,
                )
        with self.latency.batch_update():
            self.latency.data = self.latency.data[:3]
            for trace, stat in zip(self.latency.data, ("p50", "p95", "p99"), strict=True):
                trace.x, trace.y = [], []
                trace.name = f"TTFT {stat}" + (f" ({names[0]})" if len(names) > 1 else "")
            for name in names[1:]:
                self.latency.add_scatter(x=[], y=[], mode="lines+markers", name=f"TTFT p95 ({name})")
            for name, levels in self._earlier:
                lat = latency_traces(levels, "ttft_ms")
                self.latency.add_scatter(
                    x=lat["x"],
                    y=lat["p95"],
                    mode="lines+markers",
                    name=f"TTFT p95, {name}",
                    line=EARLIER,
                    marker=EARLIER,
                )
        self._draw(self.throughput, self.latency)

    def _on_capacity(self, capacity: dict[str, Any]) -> None:
        t = capacity_traces(capacity)
        with self.capacity.batch_update():
            self.capacity.layout.title = {"text": capacity_title(capacity)}
            self.capacity.data[0].x, self.capacity.data[0].y = t["x"], t["y"]
            self.capacity.data[0].name = t["name"]
            self.capacity.data[1].x, self.capacity.data[1].y = t["current_x"], t["current_y"]
            self.capacity.data[2].x, self.capacity.data[2].y = t["probe_x"], t["probe_y"]
            self.capacity.data[3].x, self.capacity.data[3].y = t["x"][: len(t["admitted_y"])], t["admitted_y"]
            self.capacity.data[3].name = t["admitted_name"]
        self._draw(self.capacity)
        self.status.value = "sweeping…"

    def _on_level(self, level: Level) -> None:
        self.levels.append(level)
        if self._line == 0:
            self._first_levels = list(self.levels)
        t = throughput_traces(self.levels)
        lat = latency_traces(self.levels, "ttft_ms")
        line = 0 if self._line == 0 else self._line + 1  # trace 1 is the knee
        with self.throughput.batch_update():
            self.throughput.data[line].x, self.throughput.data[line].y = t["x"], t["y"]
            self.throughput.data[line].error_y = {"type": "data", "array": t["err"], "visible": True}
            self.throughput.data[1].x, self.throughput.data[1].y = t["knee_x"], t["knee_y"]
        with self.latency.batch_update():
            if self._line == 0:
                for trace, stat in zip(self.latency.data[:3], ("p50", "p95", "p99"), strict=True):
                    trace.x, trace.y = lat["x"], lat[stat]
            else:
                self.latency.data[self._line + 2].x, self.latency.data[self._line + 2].y = lat["x"], lat["p95"]
        self.progress.value = sum(len(p.levels) for p in self.profiles) + len(self.levels)
        self.status.value = (
            f"concurrency {level.concurrency}: {level.output_tokens_per_s:.1f} tok/s, "
            f"TTFT p95 {level.ttft_ms.p95 or 0:.0f} ms"
        )
        self._draw(self.throughput, self.latency)


def _view() -> w.Output:
    """Where one figure is drawn: its share of the cell's width, at least 320 px, at most all of it."""
    return w.Output(layout=w.Layout(flex="1 1 440px", min_width="320px", max_width="100%"))


class _Empty:
    capacity = None
