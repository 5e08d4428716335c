"""One definition per engine setting: the config key, the serve flag, the traitlet and the docs row
all come from `config.EngineSettings`; the committed docs page is the generated one."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from magnitude_jupyter.cli.configuration_doc import extension_only, render_configuration, serve_only
from magnitude_jupyter.config import ENGINE_KEYS, ConfigError, EngineSettings, load_settings
from magnitude_jupyter.settings_surface import engine_overrides, engine_settings

ROOT = Path(__file__).resolve().parent.parent


def test_the_configuration_page_is_the_generated_one():
    committed = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == render_configuration(), (
        "run: python -m magnitude_jupyter.cli.configuration_doc > docs/configuration.md"
    )


def test_every_engine_setting_is_a_config_key_a_serve_flag_and_a_traitlet():
    from magnitude_jupyter.cli.main import serve
    from magnitude_jupyter.server.extension import MagnitudeApp

    names = {s.name for s in engine_settings()}
    assert names == set(ENGINE_KEYS) == {f.name for f in dataclasses.fields(EngineSettings)}
    flags = {param.name for param in serve.params}
    assert names <= flags
    traits = set(MagnitudeApp.class_traits(config=True))
    assert names <= traits
    page = render_configuration()
    for setting in engine_settings():
        assert f"| `{setting.name}` |" in page
        assert setting.help, setting.name


def test_every_serve_option_extension_traitlet_and_config_key_has_its_row():
    """The rows no engine setting makes are read off the serve command, the extension and
    `config.Settings`: an option added to one of them gets its row, with its help."""
    from magnitude_jupyter.cli.main import serve
    from magnitude_jupyter.config import TOP_KEYS

    page = render_configuration()
    rows = serve_only()
    assert {"--host", "--port", "--token", "--no-auth", "--force"} <= {s.split(", ")[-1] for s, _ in rows}
    assert ("-m, --model", "Model alias or .gguf path (default: from config).") in rows
    engine = {s.name for s in engine_settings()}
    assert len(rows) == len([p for p in serve.params if p.name not in engine and not p.name.startswith("slo_")])
    for spelling, text in rows:
        assert text and f"| `{spelling}` |" in page, spelling
    for name, text in extension_only():
        assert text and f"| `c.MagnitudeApp.{name}` |" in page, name
    assert {name for name, _ in extension_only()} == {"model", "max_body_bytes", "load_model_at_start"}
    for name in TOP_KEYS:
        assert f"| `{name}` |" in page, name


def test_every_engine_key_is_read_from_the_file(tmp_path):
    defaults = EngineSettings()
    engine = {s.name: getattr(defaults, s.name) for s in engine_settings()}
    engine["ctx_size"] = "auto"  # memory_budget is only taken with ctx_size auto
    engine["memory_budget"] = "1GiB"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"engine": engine}))
    settings = load_settings(path, environ={})
    assert settings.engine.memory_budget == "1GiB" and settings.engine.parallel == defaults.parallel


def test_choices_are_checked_from_the_same_definition(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("engine:\n  prefix_cache_scope: everyone\n")
    with pytest.raises(ConfigError, match=r"prefix_cache_scope.*shared, user"):
        load_settings(path, environ={})


def test_flag_values_are_parsed_by_the_settings_kind():
    assert engine_overrides({"ctx_size": "auto", "parallel": 4, "mlock": None}) == {"ctx_size": "auto", "parallel": 4}
    assert engine_overrides({"ctx_size": "4096"}) == {"ctx_size": 4096}
    with pytest.raises(ValueError, match="--ctx-size"):
        engine_overrides({"ctx_size": "lots"})


def test_the_threads_help_says_what_zero_means_everywhere():
    (threads,) = [s for s in engine_settings() if s.name == "threads"]
    assert "other processes leave free" in threads.help
    from click.testing import CliRunner

    from magnitude_jupyter.cli.main import main

    output = CliRunner().invoke(main, ["serve", "--help"]).output
    assert "other processes leave free" in " ".join(output.split())


def test_magnitude_help_lists_every_command_with_its_options(capsys):
    from magnitude_jupyter.calibrate.options import CalibrateOptions
    from magnitude_jupyter.magics import LINE_COMMANDS, MagnitudeMagics, cell_parser, help_text

    text = help_text()
    for command in LINE_COMMANDS:
        assert f"%magnitude {command}" in text
    for action in cell_parser()._actions:
        assert action.option_strings[0] in text
    from magnitude_jupyter.options import flag_names

    for flag in flag_names(CalibrateOptions).values():
        assert flag in text
    magics = MagnitudeMagics(None)
    for line, cell in (("help", None), ("--help", "ignored")):  # %magnitude help, %%magnitude --help
        magics.magnitude(line, cell)
        assert capsys.readouterr().out.strip() == text


def test_calibration_defaults_are_one_everywhere():
    from magnitude_jupyter.calibrate import options
    from magnitude_jupyter.calibrate.sweep import SweepConfig
    from magnitude_jupyter.magics import line_parser

    config = SweepConfig()
    args = line_parser().parse_args(["calibrate"])
    assert config.latency_target_ms == args.latency_target_ms == options.DEFAULT_LATENCY_TARGET_MS
    assert config.requests_per_level == args.requests and config.max_tokens == args.max_tokens
    assert config.warmup_requests == args.warmup and ",".join(map(str, config.concurrency)) == args.concurrency
    from click.testing import CliRunner

    from magnitude_jupyter.cli.main import main

    shown = " ".join(CliRunner().invoke(main, ["calibrate", "--help"]).output.split())
    assert f"[default: {options.DEFAULT_LATENCY_TARGET_MS}]" in shown


def test_every_declared_option_is_spelled_the_same_on_the_cli_and_in_the_magics():
    """Batch and calibration options are one declaration each (`options.option`): the `magnitude`
    command's click options and the magics' argparse arguments carry every one, by the same flags,
    and calibration's by the same defaults."""
    import click

    from magnitude_jupyter.batch.options import BatchOptions
    from magnitude_jupyter.calibrate.options import CalibrateOptions
    from magnitude_jupyter.cli.main import main
    from magnitude_jupyter.magics import line_parser
    from magnitude_jupyter.options import options_of

    line = line_parser()
    commands = next(a for a in line._actions if a.dest == "command").choices
    context = click.Context(main)
    for cls, name in ((BatchOptions, "batch"), (CalibrateOptions, "calibrate")):
        cli = {p.name: p for p in main.get_command(context, name).params}
        magic = {a.dest: a for a in commands[name]._actions}
        for item, spelled in options_of(cls):
            flags = spelled.flags(item.name)
            assert set(flags) <= set(cli[item.name].opts) | set(cli[item.name].secondary_opts), item.name
            assert set(flags) == set(magic[item.name].option_strings), item.name
            if cls is CalibrateOptions:
                assert cli[item.name].default == magic[item.name].default == item.default, item.name
