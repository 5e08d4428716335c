"""The magics' parser: typed argument objects, the batch and calibration options declared once, errors
as one line. No server, no kernel."""

from __future__ import annotations

import pytest

from magnitude_jupyter.calibrate.options import CalibrateOptions
from magnitude_jupyter.calibrate.sweep import SweepConfig
from magnitude_jupyter.magics.arguments import (
    LINE_COMMANDS,
    Batch,
    Calibrate,
    CellArgs,
    Help,
    History,
    MagnitudeError,
    Use,
    cell_parser,
    parse_cell,
    parse_line,
)
from magnitude_jupyter.options import options_of


def test_a_cell_parses_into_typed_arguments():
    args = parse_cell(["-m", "tiny", "-t", "0.5", "--stop", "a", "b", "--chat", "--max-tokens", "9"])
    assert isinstance(args, CellArgs)
    assert (args.model, args.temperature, args.stop, args.chat, args.max_tokens) == (
        "tiny",
        0.5,
        ["a", "b"],
        "default",
        9,
    )
    assert args.batch == {} and args.batch_only() == []


def test_batch_options_of_a_cell_are_kept_apart_from_the_shared_ones():
    args = parse_cell(["--df", "reviews", "-m", "tiny", "--labels", "good,bad", "--concurrency", "2"])
    assert args.batch == {"labels": "good,bad", "concurrency": 2}
    assert args.batch_options() == {"model": "tiny", "labels": "good,bad", "concurrency": 2}
    assert parse_cell(["--json"]).batch_only() == ["json_object"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--compare", "a,b", "-m", "c"], "--compare names the models itself"),
        (["--tools", "f", "-f", "json"], "--tools answers in text"),
        (["--tools", "f", "--max-steps", "0"], "--max-steps must be at least 1"),
        (["--temperature", "warm"], "invalid float value"),
        (["--format", "yaml"], "invalid choice"),
    ],
)
def test_bad_cell_options_are_one_line(argv, message):
    with pytest.raises(MagnitudeError, match=message) as caught:
        parse_cell(argv)
    assert caught.value._render_traceback_()[0].startswith("magnitude: ")


def test_each_line_command_parses_into_its_own_type():
    assert parse_line(["use", "tiny"]) == Use(model="tiny")
    assert parse_line(["history"]) == History()
    assert parse_line(["history", "work"]).chat == "work"
    assert parse_line(["help"]) == Help() == parse_line(["--help"])
    batch = parse_line(["batch", "df", "--template", "Rate {text}", "-o", "scored", "--json", "-m", "tiny"])
    assert batch == Batch(
        df="df", template="Rate {text}", output="scored", batch={"json_object": True, "model": "tiny"}
    )
    assert {cls.name for cls in LINE_COMMANDS.values()} == set(LINE_COMMANDS)


def test_calibrate_parses_into_the_options_the_cli_uses():
    args = parse_line(["calibrate", "--concurrency", "1,2", "--latency-target-ms", "1500", "--start"])
    assert isinstance(args, Calibrate) and args.start
    assert args.options == CalibrateOptions(concurrency="1,2", latency_target_ms=1500.0)
    assert SweepConfig.from_options(args.options).concurrency == (1, 2)
    assert parse_line(["calibrate"]).options == CalibrateOptions()  # one default everywhere
    assert [f.name for f, _ in options_of(CalibrateOptions)] == list(CalibrateOptions.__dataclass_fields__)


def test_missing_or_unknown_commands_say_what_to_do():
    with pytest.raises(MagnitudeError, match="say what to do"):
        parse_line([])
    with pytest.raises(MagnitudeError, match="required: model"):
        parse_line(["use"])
    with pytest.raises(MagnitudeError, match="invalid choice"):
        parse_line(["launch"])
    with pytest.raises(ValueError, match="--agent is a kind of --workflow"):  # the CLI's error as well
        parse_line(["calibrate", "--agent"]).options.validate()


def test_every_cell_field_is_an_option():
    flags = {action.dest for action in cell_parser()._actions}
    assert set(CellArgs.__dataclass_fields__) - {"batch"} <= flags
