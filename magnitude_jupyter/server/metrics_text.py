"""The engine's metrics in Prometheus' text exposition format."""

from __future__ import annotations

from typing import Any

from ..engine.metrics import EngineMetrics, Histogram


def _histogram(lines: list[str], name: str, help_text: str, hist: Histogram) -> None:
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
    for bound, count in hist.cumulative():
        le = "+Inf" if bound == float("inf") else f"{bound:g}"
        lines.append(f'{name}_bucket{{le="{le}"}} {count}')
    lines += [f"{name}_sum {hist.total:.6f}", f"{name}_count {hist.n}"]


def render_metrics(metrics: EngineMetrics, status: dict[str, Any]) -> str:
    lines: list[str] = []
    model = status.get("model", "")

    def gauge(name: str, help_text: str, value: float) -> None:
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f'{name}{{model="{model}"}} {value}'])

    lines += [
        "# HELP magnitude_requests_total Finished requests by outcome.",
        "# TYPE magnitude_requests_total counter",
    ]
    for outcome in ("stop", "length", "cancelled", "error"):
        lines.append(f'magnitude_requests_total{{outcome="{outcome}"}} {metrics.requests_by_outcome.get(outcome, 0)}')
    lines += [
        "# HELP magnitude_prompt_tokens_total Prompt tokens of finished requests.",
        "# TYPE magnitude_prompt_tokens_total counter",
        f"magnitude_prompt_tokens_total {metrics.prompt_tokens_total}",
        "# HELP magnitude_generation_tokens_total Tokens generated.",
        "# TYPE magnitude_generation_tokens_total counter",
        f"magnitude_generation_tokens_total {metrics.generation_tokens_total}",
    ]
    _histogram(lines, "magnitude_time_to_first_token_seconds", "Arrival to first token.", metrics.ttft)
    _histogram(lines, "magnitude_e2e_request_latency_seconds", "Arrival to last token.", metrics.e2e)
    total = status.get("kv_cells_total") or 0
    gauge(
        "magnitude_kv_usage_ratio",
        "KV cells reserved by running requests / all cells.",
        round(status.get("kv_cells_reserved", 0) / total, 6) if total else 0,
    )
    gauge("magnitude_kv_cells_used", "KV cells holding tokens.", status.get("kv_cells_used", 0))
    gauge("magnitude_requests_running", "Requests being decoded.", status.get("running", 0))
    gauge("magnitude_requests_waiting", "Requests queued for KV cells or a slot.", status.get("waiting", 0))
    gauge(
        "magnitude_recent_tokens_per_second",
        "Generated tokens/s over the last seconds.",
        status.get("recent_tokens_per_s", 0),
    )
    return "\n".join(lines) + "\n"
