"""`%magnitude calibrate`: the sweep widget, or the workflow sweep with a plot that grows as it runs."""

from __future__ import annotations

import argparse
from typing import Any

from IPython.display import display

from .client import Client

CALIBRATION_VARIABLE = "_magnitude_calibration"


def calibrate_cell(client: Client, args: argparse.Namespace, user_ns: dict[str, Any]) -> Any:
    """Raises ValueError (bad levels) or ClientError; the magic turns both into a clear message."""
    from .calibrate.sweep import SweepConfig, parse_levels
    from .calibrate.widget import CalibrationWidget

    if args.model:  # a server with many models: load it first, so that its own engine is measured
        client = client.for_model(client.load_model(args.model)["id"] if client.is_magnitude() else args.model)
    if args.agent and not args.workflow:
        raise ValueError("--agent is a kind of --workflow sweep: give both")
    if args.workflow:
        return _workflow(client, args, user_ns)
    config = SweepConfig(
        concurrency=parse_levels(args.concurrency),
        requests_per_level=args.requests,
        max_tokens=args.max_tokens,
        latency_target_ms=args.latency_target_ms,
        ttft_p95_limit_ms=args.ttft_limit_ms,
        min_seconds_per_level=args.min_seconds,
        warmup_requests=args.warmup,
        prompt=args.prompt,
        model=client.model,
    )
    config.validate()
    widget = CalibrationWidget(client, config, probe=not args.no_probe)
    if client.model in widget.model.options:
        widget.model.value = (client.model,)
    user_ns[CALIBRATION_VARIABLE] = widget
    if args.start:
        widget.start()
    return widget


def _workflow(client: Client, args: argparse.Namespace, user_ns: dict[str, Any]) -> None:
    """The workflow sweep in the cell: its plot grows a line per number of sessions as they finish."""
    from .calibrate.figures import figure_bundle, workflow_figure
    from .calibrate.run import calibrate_workflow
    from .calibrate.sweep import parse_levels
    from .calibrate.workflow import WorkflowLevel, WorkflowResult, format_workflow

    try:
        sessions = parse_levels(args.sessions)
    except ValueError as exc:
        raise ValueError(str(exc).replace("concurrency", "session")) from None
    done: list[WorkflowLevel] = []

    def figure() -> dict[str, Any]:
        result = WorkflowResult(args.slo_round_p95_ms, args.rounds, args.max_tokens, tuple(done), args.agent)
        return figure_bundle(workflow_figure(result))

    # Plain plotly output, updated in place as each level ends (not a FigureWidget: see figure_bundle).
    plot = display(figure(), raw=True, display_id=True)

    def on_level(level: WorkflowLevel) -> None:
        done.append(level)
        plot.update(figure(), raw=True)

    profile = calibrate_workflow(
        client, sessions, args.rounds, args.max_tokens, args.slo_round_p95_ms, on_level=on_level, agent=args.agent
    )
    assert profile.workflow is not None
    print(format_workflow(profile.workflow))
    user_ns[CALIBRATION_VARIABLE] = profile
