"""The calibration options, declared once: `CalibrateOptions`' fields are `magnitude calibrate`'s
click options, `%magnitude calibrate`'s arguments, `SweepConfig`'s defaults and the widget's start
values, so a cell, the widget and the shell give the same verdict for the same run.

Imports nothing heavy: every `magnitude` command imports the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..options import option

DEFAULT_CONCURRENCY = "1,2,4,8,16"
DEFAULT_REQUESTS = 16
DEFAULT_MAX_TOKENS = 64
DEFAULT_WARMUP = 2
# One objective for the sweep's recommended `parallel` (p95 end-to-end) and the workflow's rounds (p95).
DEFAULT_LATENCY_TARGET_MS = 3000.0
DEFAULT_SLO_ROUND_P95_MS = 3000.0
DEFAULT_SESSIONS = "1,4,8"
DEFAULT_CONTEXTS = "256,1024,4096"
DEFAULT_ROUNDS = 6


@dataclass(frozen=True)
class CalibrateOptions:
    """What one calibration asks for, as the CLI and the magic parse it."""

    concurrency: str = option(DEFAULT_CONCURRENCY, "Concurrency levels, comma-separated.")
    requests: int = option(DEFAULT_REQUESTS, "Requests per level.")
    max_tokens: int = option(DEFAULT_MAX_TOKENS, "New tokens per request.")
    min_seconds: float | None = option(None, "Run each level at least this long (steadier figures).")
    warmup: int = option(DEFAULT_WARMUP, "Requests sent before the first level.")
    prompt: str | None = option(None, "One prompt for every request (a cache hit after the first).")
    latency_target_ms: float | None = option(
        DEFAULT_LATENCY_TARGET_MS, "The p95 end-to-end latency the recommended parallel must meet."
    )
    ttft_limit_ms: float | None = option(None, "Stop when a level's p95 TTFT is over this.")
    no_probe: bool = option(False, "Skip the capacity probe.")
    workflow: bool = option(False, "Sweep concurrent multi-round sessions instead (agent workflows).")
    sessions: str = option(DEFAULT_SESSIONS, "With --workflow: concurrent sessions, per level.")
    rounds: int = option(DEFAULT_ROUNDS, "With --workflow: rounds per session.")
    agent: bool = option(False, "With --workflow: tool-using agent sessions (call, result, next call).")
    slo_round_p95_ms: float = option(
        DEFAULT_SLO_ROUND_P95_MS, "With --workflow: the p95 round latency every round must meet."
    )
    pressure_map: bool = option(
        False,
        "Measure every concurrency level at every context length of --contexts (a heatmap), instead of one sweep.",
    )
    contexts: str = option(DEFAULT_CONTEXTS, "With --pressure-map: tokens of context per session, comma-separated.")
    model: str | None = option(
        None, "Calibrate this model (a server with many models loads it first).", "--model", "-m"
    )

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> CalibrateOptions:
        """The options among parsed values (a click command's keywords, an argparse namespace's dict)."""
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})

    def validate(self) -> None:
        if self.agent and not self.workflow:
            raise ValueError("--agent is a kind of --workflow sweep: give both")
        if self.pressure_map and self.workflow:
            raise ValueError("--pressure-map and --workflow are two kinds of run: give one")

    def context_levels(self) -> tuple[int, ...]:
        return parse_contexts(self.contexts)

    def session_levels(self) -> tuple[int, ...]:
        try:
            return parse_levels(self.sessions)
        except ValueError as exc:
            raise ValueError(str(exc).replace("concurrency", "session")) from None


def parse_levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise ValueError(f"concurrency levels must be integers separated by commas, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise ValueError("give at least one concurrency level, each 1 or more")
    return levels


def parse_contexts(text: str) -> tuple[int, ...]:
    try:
        contexts = tuple(int(x) for x in text.replace(" ", "").replace("_", "").split(",") if x)
    except ValueError:
        raise ValueError(f"contexts must be token counts separated by commas, got {text!r}") from None
    if not contexts or min(contexts) < 64:
        raise ValueError("give at least one context length, each 64 tokens or more")
    return tuple(sorted(set(contexts)))
