"""A dataclass field that a person also sets by hand, declared once: `option(default, help, ...)`.

Every surface that takes settings reads the same `Option`: the config file's keys and engine
settings (`config/`), `magnitude serve`'s flags and the extension's traitlets (`settings_surface`),
the calibration and batch options the CLI and the magics share, and the magics' own arguments. The
argparse and click builders here make a surface's arguments from a dataclass's fields, their types
from the annotations; docs/configuration.md is generated from the same declarations.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

OPTION = "option"  # the metadata key an Option travels under


@dataclass(frozen=True)
class Option:
    """How one field is set by hand: its help, its command-line spellings (none given: `--field-name`),
    its choices; for the config file, the kind of text its value is parsed from, whether a model's own
    settings may change it and whether a MAGNITUDE_* variable sets it."""

    help: str
    names: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None
    kind: str | None = None  # int, float, bool, str, duration, with "|null" / "|auto" variants
    per_model: bool = True
    env: bool = False
    positional: bool = False
    type: type | None = None  # the command-line value's type where the annotation is not it
    extra: tuple[tuple[str, Any], ...] = ()  # argparse's own: nargs, const, required

    def flags(self, name: str) -> list[str]:
        return list(self.names) or ["--" + name.replace("_", "-")]


def option(
    default: Any,
    help: str,
    *names: str,
    factory: bool = False,
    choices: tuple[str, ...] | None = None,
    kind: str | None = None,
    per_model: bool = True,
    env: bool = False,
    positional: bool = False,
    type: type | None = None,
    **extra: Any,
) -> Any:
    """A dataclass field (default, or a factory with `factory`) that is also an option."""
    spelled = Option(help, names, choices, kind, per_model, env, positional, type, tuple(extra.items()))
    if factory:
        return dataclasses.field(default_factory=default, metadata={OPTION: spelled})
    return dataclasses.field(default=default, metadata={OPTION: spelled})


def option_of(item: dataclasses.Field[Any]) -> Option:
    """The field's option (a LookupError for a field that is not one)."""
    spelled = item.metadata.get(OPTION)
    if spelled is None:
        raise LookupError(f"the field {item.name!r} is not an option")
    return spelled


def options_of(cls: type) -> list[tuple[dataclasses.Field[Any], Option]]:
    """The fields of `cls` that are options, in the order they are declared."""
    return [(item, item.metadata[OPTION]) for item in dataclasses.fields(cls) if OPTION in item.metadata]


def flag_names(cls: type) -> dict[str, str]:
    """Each option's first command-line spelling, by field name (for messages that name a flag)."""
    return {item.name: spelled.flags(item.name)[0] for item, spelled in options_of(cls)}


def value_type(cls: type, item: dataclasses.Field[Any]) -> tuple[type, bool]:
    """(the scalar type, is it a list) of a field: its option's `type`, else its annotation's
    (`int | None` → int, `list[str] | None` → (str, True))."""
    spelled = item.metadata.get(OPTION)
    if spelled is not None and spelled.type is not None:
        return spelled.type, False
    hint = typing.get_type_hints(cls)[item.name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(h for h in typing.get_args(hint) if h is not type(None))
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], True
    return hint, False


def _default(item: dataclasses.Field[Any]) -> Any:
    return None if item.default is dataclasses.MISSING else item.default


def add_arguments(
    parser: argparse.ArgumentParser, cls: type, *, skip: Iterable[str] = (), unset_is_none: bool = False
) -> None:
    """The options of `cls` on an argparse parser. With `unset_is_none`, an option not given parses as
    None (its default shown in its help), so that a caller can tell what was given."""
    skipped = set(skip)
    for item, spelled in options_of(cls):
        if item.name in skipped:
            continue
        default = _default(item)
        kind, many = value_type(cls, item)
        help_text = spelled.help
        if unset_is_none and default is not None and kind is not bool:
            help_text = f"{help_text} (default: {default})"
        given = None if unset_is_none else default
        if spelled.positional:
            nargs: dict[str, Any] = {"nargs": "?"} if default is not None else {}
            parser.add_argument(item.name, default=default, help=help_text, **nargs)
        elif kind is bool:
            parser.add_argument(
                *spelled.flags(item.name), dest=item.name, action="store_true", default=given, help=help_text
            )
        else:
            extra: dict[str, Any] = {"nargs": "+"} if many else {}
            extra.update(spelled.extra)
            parser.add_argument(
                *spelled.flags(item.name),
                dest=item.name,
                type=kind,
                choices=spelled.choices,
                default=given,
                help=help_text,
                **extra,
            )


def click_options(
    cls: type, *, skip: Iterable[str] = (), unset_is_none: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The options of `cls` as click options (a decorator). With `unset_is_none`, an option not given
    is None (its default shown in its help)."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        import click

        skipped = set(skip)
        for item, spelled in reversed(options_of(cls)):
            if item.name in skipped or spelled.positional:
                continue
            default = _default(item)
            kind, _ = value_type(cls, item)
            names = spelled.flags(item.name)
            if kind is bool:
                given = None if unset_is_none else bool(default)
                command = click.option(*names, item.name, is_flag=True, default=given, help=spelled.help)(command)
                continue
            choice: Any = click.Choice(spelled.choices) if spelled.choices else kind
            if unset_is_none:
                help_text = f"{spelled.help}  [default: {default}]" if default is not None else spelled.help
                command = click.option(*names, item.name, type=choice, default=None, help=help_text)(command)
            else:
                command = click.option(
                    *names, item.name, type=choice, default=default, show_default=default is not None, help=spelled.help
                )(command)
        return command

    return decorate


def given_values(cls: type, values: Any) -> dict[str, Any]:
    """The options of `cls` set in parsed arguments (an argparse Namespace or a dict), by field name."""
    values = values if isinstance(values, dict) else vars(values)
    return {item.name: values[item.name] for item, _ in options_of(cls) if values.get(item.name) is not None}
