"""Every engine setting's flag, traitlet and documentation row, made from its one definition.

`config.EngineSettings` declares each setting once (name, type, default, and its `options.Option`: help,
kind, per model, environment variable, choices). `magnitude serve`'s options and the Jupyter
extension's traitlets are generated here from it; docs/configuration.md from them
(cli/configuration_doc.py), and a test checks that they agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .config import (
    ENV_OVERRIDES,
    KIND_PARSERS,
    ConfigError,
    EngineSettings,
    Settings,
    SloSettings,
    parse_keep_alive,
)
from .options import options_of


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # int, float, bool, str, and "|null" / "|auto" / "bytes|fraction" variants
    default: Any
    help: str
    per_model: bool
    env: str | None
    choices: tuple[str, ...] | None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def is_bool(self) -> bool:
        return self.kind.startswith("bool")


def engine_settings() -> list[Setting]:
    """The engine's settings, in the order they are declared."""
    env_of = {key: var for var, (section, key, _) in ENV_OVERRIDES.items() if section == "engine"}
    return [
        Setting(
            name=item.name,
            kind=spelled.kind or "str",
            default=item.default,
            help=spelled.help,
            per_model=spelled.per_model,
            env=env_of.get(item.name),
            choices=spelled.choices,
        )
        for item, spelled in options_of(EngineSettings)
    ]


SLO_PREFIX = "slo_"


def slo_settings() -> list[Setting]:
    """The objectives' settings (`slo:` keys), named as their flags and traitlets are: `slo_<key>`."""
    return [
        Setting(
            name=SLO_PREFIX + item.name,
            kind=spelled.kind or "str",
            default=item.default,
            help=spelled.help,
            per_model=True,
            env=None,
            choices=None,
        )
        for item, spelled in options_of(SloSettings)
    ]


def slo_overrides(values: dict[str, Any]) -> dict[str, Any]:
    """The objectives given as flags or traitlets (`slo_<key>`), as `slo:` keys; a ValueError names the flag."""
    out: dict[str, Any] = {}
    for setting in slo_settings():
        value = values.get(setting.name)
        if value is None:
            continue
        key = setting.name.removeprefix(SLO_PREFIX)
        if setting.is_bool or setting.kind == "str|null":
            out[key] = value
            continue
        try:
            out[key] = parse_keep_alive(value) if key == "window" else float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{setting.flag}: {setting.help} Got {value!r}") from None
    return out


def with_slo(settings: Settings, values: dict[str, Any]) -> Settings:
    """`settings` with the objectives given as flags or traitlets over the config's."""
    overrides = slo_overrides(values)
    if not overrides:
        return settings
    try:
        return dataclasses.replace(settings, slo=dataclasses.replace(settings.slo, **overrides))
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


# -- magnitude serve ---------------------------------------------------------------------------------


def engine_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Click options for every engine setting and objective (unset: the config file decides)."""
    import click

    for setting in reversed([*engine_settings(), *slo_settings()]):
        section = (
            f"slo.{setting.name.removeprefix(SLO_PREFIX)}"
            if setting.name.startswith(SLO_PREFIX)
            else f"engine.{setting.name}"
        )
        help_text = f"{setting.help} [{section}]"
        if setting.is_bool:
            negative = "--no-" + setting.flag[2:]
            option = click.option(f"{setting.flag}/{negative}", setting.name, default=None, help=help_text)
        elif setting.choices:
            option = click.option(setting.flag, setting.name, type=click.Choice(setting.choices), help=help_text)
        else:
            kind = {"int": int, "float": float, "float|null": float}.get(setting.kind, str)
            option = click.option(setting.flag, setting.name, type=kind, default=None, help=help_text)
        command = option(command)
    return command


def engine_overrides(values: dict[str, Any]) -> dict[str, Any]:
    """The engine settings given on the command line, parsed (a ValueError names the flag)."""
    settings = {s.name: s for s in engine_settings()}
    out: dict[str, Any] = {}
    for name, value in values.items():
        if value is None or name not in settings:
            continue
        setting = settings[name]
        if isinstance(value, str) and setting.kind in KIND_PARSERS:
            try:
                value = KIND_PARSERS[setting.kind](value)
            except ValueError:
                raise ValueError(f"{setting.flag}: {setting.help.split(';')[0]} Got {value!r}") from None
        out[name] = value
    return out


# -- the Jupyter extension ---------------------------------------------------------------------------


def engine_traits() -> dict[str, Any]:
    """A traitlet for every engine setting (None: the config file decides)."""
    from traitlets import Bool, Float, Integer, Unicode, Union

    traits: dict[str, Any] = {}
    for s in [*engine_settings(), *slo_settings()]:
        if s.is_bool:
            traits[s.name] = Bool(None, allow_none=True, config=True, help=s.help)
        elif s.kind == "int":
            traits[s.name] = Integer(None, allow_none=True, config=True, help=s.help)
        elif s.kind in ("float", "float|null"):
            traits[s.name] = Float(None, allow_none=True, config=True, help=s.help)
        elif s.kind == "duration":
            traits[s.name] = Union([Float(), Unicode()], default_value=None, allow_none=True, config=True, help=s.help)
        elif s.kind == "int|auto":
            traits[s.name] = Union(
                [Integer(), Unicode()], default_value=None, allow_none=True, config=True, help=s.help
            )
        elif s.kind == "bytes|fraction":
            kinds = [Integer(), Float(), Unicode()]
            traits[s.name] = Union(kinds, default_value=None, allow_none=True, config=True, help=s.help)
        else:
            traits[s.name] = Unicode(None, allow_none=True, config=True, help=s.help)
    return traits
