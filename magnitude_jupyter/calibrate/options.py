"""The calibration options, declared once: `magnitude calibrate`'s click options, `%magnitude
calibrate`'s argparse arguments, `SweepConfig`'s defaults and the widget's start values all come
from `CALIBRATE_OPTIONS`, so a cell, the widget and the shell give the same verdict for the same run.

Imports nothing heavy: every `magnitude` command imports the CLI.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_CONCURRENCY = "1,2,4,8,16"
DEFAULT_REQUESTS = 16
DEFAULT_MAX_TOKENS = 64
DEFAULT_WARMUP = 2
# One objective for the sweep's recommended `parallel` (p95 end-to-end) and the workflow's rounds (p95).
DEFAULT_LATENCY_TARGET_MS = 3000.0
DEFAULT_SLO_ROUND_P95_MS = 3000.0
DEFAULT_SESSIONS = "1,4,8"
DEFAULT_ROUNDS = 6


@dataclass(frozen=True)
class Option:
    """One calibration option: its flag, the keyword it becomes, its type (None: an on/off flag),
    its default and its help."""

    flag: str
    dest: str
    type: type | None
    default: Any
    help: str
    short: str | None = None


CALIBRATE_OPTIONS = (
    Option("--concurrency", "concurrency", str, DEFAULT_CONCURRENCY, "Concurrency levels, comma-separated."),
    Option("--requests", "requests", int, DEFAULT_REQUESTS, "Requests per level."),
    Option("--max-tokens", "max_tokens", int, DEFAULT_MAX_TOKENS, "New tokens per request."),
    Option("--min-seconds", "min_seconds", float, None, "Run each level at least this long (steadier figures)."),
    Option("--warmup", "warmup", int, DEFAULT_WARMUP, "Requests sent before the first level."),
    Option("--prompt", "prompt", str, None, "One prompt for every request (a cache hit after the first)."),
    Option(
        "--latency-target-ms",
        "latency_target_ms",
        float,
        DEFAULT_LATENCY_TARGET_MS,
        "The p95 end-to-end latency the recommended parallel must meet.",
    ),
    Option("--ttft-limit-ms", "ttft_limit_ms", float, None, "Stop when a level's p95 TTFT is over this."),
    Option("--no-probe", "no_probe", None, False, "Skip the capacity probe."),
    Option("--workflow", "workflow", None, False, "Sweep concurrent multi-round sessions instead (agent workflows)."),
    Option("--sessions", "sessions", str, DEFAULT_SESSIONS, "With --workflow: concurrent sessions, per level."),
    Option("--rounds", "rounds", int, DEFAULT_ROUNDS, "With --workflow: rounds per session."),
    Option("--agent", "agent", None, False, "With --workflow: tool-using agent sessions (call, result, next call)."),
    Option(
        "--slo-round-p95-ms",
        "slo_round_p95_ms",
        float,
        DEFAULT_SLO_ROUND_P95_MS,
        "With --workflow: the p95 round latency every round must meet.",
    ),
    Option("--model", "model", str, None, "Calibrate this model (a server with many models loads it first).", "-m"),
)


def click_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The calibration options as click options."""
    import click

    for option in reversed(CALIBRATE_OPTIONS):
        names = [option.flag, *([option.short] if option.short else [])]
        if option.type is None:
            command = click.option(*names, option.dest, is_flag=True, help=option.help)(command)
        else:
            show = option.default is not None
            command = click.option(
                *names, option.dest, type=option.type, default=option.default, show_default=show, help=option.help
            )(command)
    return command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The calibration options as argparse arguments (the magics)."""
    for option in CALIBRATE_OPTIONS:
        names = [option.flag, *([option.short] if option.short else [])]
        if option.type is None:
            parser.add_argument(*names, dest=option.dest, action="store_true", help=option.help)
        else:
            parser.add_argument(*names, dest=option.dest, type=option.type, default=option.default, help=option.help)
