"""A calibration profile: the machine, the model, the engine settings, every level, and a summary.

Saved as JSON (the source of truth), CSV (the levels) and a standalone HTML report with the plots;
several profiles compare as one DataFrame and overlaid plots.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .pressure import PressureMap
from .records import Level, Summary
from .stats import knee, knee_not_reached, recommend_parallel, scaling_efficiency
from .workflow import WorkflowResult

PROFILE_VERSION = 1


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    memory = None
    with contextlib.suppress(ValueError, OSError, AttributeError):
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": memory,
        "platform": platform.platform(),
        "hostname": platform.node(),
    }


def summarize_levels(
    levels: list[Level], engine: dict[str, Any], model: dict[str, Any], latency_target_ms: float | None = None
) -> Summary:
    closed = [lv for lv in levels if lv.concurrency]
    thr = {lv.concurrency: lv.output_tokens_per_s for lv in closed if lv.concurrency}
    peak = max(closed, key=lambda lv: lv.output_tokens_per_s) if closed else None
    knee_c = knee(list(thr.items()))
    at_knee = next((lv for lv in closed if lv.concurrency == knee_c), None)
    trained = model.get("trained_context")
    ctx = engine.get("ctx_size")
    return Summary(
        single_stream_tokens_per_s=thr.get(1),
        peak_tokens_per_s=peak.output_tokens_per_s if peak else None,
        peak_concurrency=peak.concurrency if peak else None,
        knee_concurrency=int(knee_c) if knee_c is not None else None,
        knee_not_reached=knee_not_reached(list(thr.items())),
        scaling_efficiency={str(c): e for c, e in scaling_efficiency(thr).items()},
        e2e_std_ms_at_knee=at_knee.e2e_ms.std if at_knee else None,
        ttft_std_ms_at_knee=at_knee.ttft_ms.std if at_knee else None,
        usable_context_ratio=(min(ctx, trained) / trained) if ctx and trained else None,
        latency_target_ms=latency_target_ms,
        recommended_parallel=recommend_parallel(closed, latency_target_ms) if latency_target_ms else None,
    )


def engine_text(engine: dict[str, Any] | None) -> str:
    """The engine's settings as a person reads them: `parallel 8, ctx_size 8,192, ...`."""
    if not engine:
        return "not reported"
    return ", ".join(
        f"{k} {v:,}" if isinstance(v, int) and not isinstance(v, bool) else f"{k} {v}"
        for k, v in engine.items()
        if v is not None
    )


@dataclass
class Profile:
    machine: dict[str, Any]
    server: dict[str, Any]
    model: dict[str, Any]
    engine: dict[str, Any]
    config: dict[str, Any]
    levels: list[Level]
    summary: Summary
    capacity: dict[str, Any] | None = None
    stopped_because: str | None = None
    workflow: WorkflowResult | None = None  # the agent-workflow sweep, when one ran
    pressure_map: PressureMap | None = None  # concurrency × context, when one was measured
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    name: str = ""
    version: int = PROFILE_VERSION

    # -- files -------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)  # nested records become plain dicts
        data["workflow"] = self.workflow.to_json() if self.workflow else None
        data["pressure_map"] = self.pressure_map.to_json() if self.pressure_map else None
        return data

    def save_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=2, default=str))
        return path

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {data.get('version')!r} is not {PROFILE_VERSION}")
        levels = [Level.from_json(lv) for lv in data.get("levels") or []]
        workflow = WorkflowResult.from_json(data["workflow"]) if data.get("workflow") else None
        summary = Summary.from_json(data.get("summary") or {})
        pmap = PressureMap.from_json(data["pressure_map"]) if data.get("pressure_map") else None
        return cls(**{**data, "levels": levels, "summary": summary, "workflow": workflow, "pressure_map": pmap})

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_json(json.loads(Path(path).read_text()))

    def levels_frame(self) -> Any:
        import pandas as pd

        return pd.DataFrame([lv.flat() for lv in self.levels])

    def workflow_frame(self) -> Any:
        """One row per (sessions, round) of the workflow sweep."""
        import pandas as pd

        rows = []
        for level in self.workflow.levels if self.workflow else ():
            for r in level.rounds:
                rows.append(
                    {
                        "sessions": level.sessions,
                        "round": r.round,
                        "e2e_ms_p50": r.e2e_ms.p50,
                        "e2e_ms_p95": r.e2e_ms.p95,
                        "e2e_ms_p99": r.e2e_ms.p99,
                        "ttft_ms_p50": r.ttft_ms.p50,
                        "prompt_tokens": r.prompt_tokens,
                        "cached_tokens": r.cached_tokens,
                        "meets_slo": level.meets_slo,
                    }
                )
        return pd.DataFrame(rows)

    def pressure_frame(self) -> Any:
        """One row per cell of the pressure map."""
        import pandas as pd

        return pd.DataFrame(self.pressure_map.rows() if self.pressure_map else [])

    def save_csv(self, path: str | Path) -> Path:
        """The levels, one row each (or a workflow profile's rounds, or a pressure map's cells)."""
        path = Path(path)
        if self.levels or not (self.workflow or self.pressure_map):
            frame = self.levels_frame()
        else:
            frame = self.workflow_frame() if self.workflow else self.pressure_frame()
        frame.to_csv(path, index=False)
        return path

    def save_html(self, path: str | Path, baseline: Profile | None = None) -> Path:
        """The report: the plots, and the summary; with a `baseline` that has a pressure map too, the
        difference map of the two."""
        from .figures import capacity_figure, latency_figure, throughput_figure, workflow_figure
        from .pressure_figures import pressure_difference_figure, pressure_figures

        figures = [throughput_figure([self]), latency_figure([self]), capacity_figure(self)] if self.levels else []
        if self.workflow:
            figures.append(workflow_figure(self.workflow))
        findings = ""
        if self.pressure_map:
            figures += pressure_figures(self.pressure_map)
            if baseline is not None and baseline.pressure_map is not None:
                name = baseline.name or f"the baseline of {baseline.created}"
                figures.append(pressure_difference_figure(self.pressure_map, baseline.pressure_map, name))
            findings = "".join(f"<li>{line}</li>" for line in self.pressure_map.recommendation())
            findings = f"<ul class='pressure'>{findings}</ul>"
        parts = [fig.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figures)]
        rows = "".join(
            f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in self.summary.to_json().items() if v not in (None, {})
        )
        html = (
            "<!doctype html><html><head><meta charset='utf-8'>"
            f"<title>magnitude profile: {self.model.get('id')}</title>"
            "<style>body{font-family:sans-serif;margin:2em}th{text-align:left;padding-right:1em}</style></head><body>"
            f"<h1>{self.model.get('id')} on {self.machine.get('cpu')}</h1>"
            f"<p>{self.created}; {self.machine.get('cores')} cores; engine: {engine_text(self.engine)}</p>"
            f"<table>{rows}</table>{findings}{''.join(parts)}</body></html>"
        )
        path = Path(path)
        path.write_text(html)
        return path


def compare(profiles: list[Profile]) -> Any:
    """One row per (profile, level): the figures side by side."""
    import pandas as pd

    frames = []
    for i, profile in enumerate(profiles):
        frame = profile.levels_frame()
        frame.insert(0, "profile", profile.name or f"{profile.model.get('id')} #{i + 1}")
        frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
