"""`%magnitude calibrate`: the sweep widget, or the workflow sweep with a plot that grows as it runs."""

from __future__ import annotations

from typing import Any

from IPython.display import display

from ..calibrate.options import CalibrateOptions
from ..calibrate.sweep import SweepConfig
from ..client.http import Client, ClientError
from .arguments import Calibrate, MagnitudeError
from .session import NotebookSession

CALIBRATION_VARIABLE = "_magnitude_calibration"


def calibrate_command(session: NotebookSession, args: Calibrate) -> Any:
    try:
        return calibrate(session.client, args, session.user_ns)
    except (ClientError, ValueError) as exc:
        raise MagnitudeError(str(exc)) from None


def calibrate(client: Client, args: Calibrate, user_ns: dict[str, Any]) -> Any:
    """Raises ValueError (bad levels) or ClientError; the magic turns both into a clear message."""
    from ..calibrate.widget import CalibrationWidget

    options = args.options
    options.validate()
    running = user_ns.get(CALIBRATION_VARIABLE)
    if isinstance(running, CalibrationWidget) and running.running():
        # A page reloaded before the notebook was saved lost the widget's output, not its run: the
        # cell run again shows the same widget, its progress and plots as they are now.
        print("A calibration is still running in this kernel: here it is again (Stop ends it).")
        return running
    if options.model:  # a server with many models: load it first, so that its own engine is measured
        model = options.model
        client = client.for_model(client.load_model(model)["id"] if client.is_magnitude() else model)
    if options.workflow:
        return _workflow(client, options, user_ns)
    config = SweepConfig.from_options(options, model=client.model)
    contexts = options.contexts if options.pressure_map else ""
    if contexts:
        options.context_levels()  # refused here, in the cell, when not numbers
    earlier = _profile(args.compare, user_ns)
    widget = CalibrationWidget.connect(client, config, probe=not options.no_probe, earlier=earlier, contexts=contexts)
    if client.model in widget.model.options:
        widget.model.value = (client.model,)
    user_ns[CALIBRATION_VARIABLE] = widget
    if args.start:
        widget.start()
    return widget


def _profile(name: str | None, user_ns: dict[str, Any]) -> Any:
    """The notebook's profile called `name` (None: no name given)."""
    from ..calibrate.profile import Profile

    if name is None:
        return None
    found = user_ns.get(name)
    if not isinstance(found, Profile):
        raise MagnitudeError(f"--compare {name}: the notebook has no calibration profile called {name!r}")
    return found


def _workflow(client: Client, options: CalibrateOptions, user_ns: dict[str, Any]) -> None:
    """The workflow sweep in the cell: its plot grows a line per number of sessions as they finish."""
    from ..calibrate.figures import figure_bundle, workflow_figure
    from ..calibrate.run import calibrate_workflow
    from ..calibrate.workflow import WorkflowLevel, WorkflowResult, format_workflow

    sessions = options.session_levels()
    done: list[WorkflowLevel] = []

    def figure() -> dict[str, Any]:
        result = WorkflowResult(
            options.slo_round_p95_ms, options.rounds, options.max_tokens, tuple(done), options.agent
        )
        return figure_bundle(workflow_figure(result))

    # Plain plotly output, updated in place as each level ends (not a FigureWidget: see figure_bundle).
    plot = display(figure(), raw=True, display_id=True)

    def on_level(level: WorkflowLevel) -> None:
        done.append(level)
        plot.update(figure(), raw=True)

    profile = calibrate_workflow(
        client,
        sessions,
        options.rounds,
        options.max_tokens,
        options.slo_round_p95_ms,
        on_level=on_level,
        agent=options.agent,
    )
    assert profile.workflow is not None
    print(format_workflow(profile.workflow))
    user_ns[CALIBRATION_VARIABLE] = profile
