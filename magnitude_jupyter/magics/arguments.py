"""The magics' arguments, declared once as typed objects: each dataclass's fields make its argparse
parser and `%magnitude help`, and parsing gives back an instance of it, never a raw Namespace.

`%%magnitude` parses into `CellArgs`; `%magnitude NAME ...` into the `LineArgs` subclass that
`LINE_COMMANDS` registers for NAME. Batch options (`--df`, `%magnitude batch`) come from
`batch_options.BatchOptions` and calibration options from `calibrate.options.CalibrateOptions`, the
same declarations the CLI uses.
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, NoReturn

from ..batch.options import add_batch_arguments, given_options
from ..calibrate.options import CalibrateOptions
from ..calibrate.options import add_arguments as add_calibrate_arguments
from ..client.conversations import DEFAULT_CHAT

FORMATS = ("text", "markdown", "json", "code")
# Options a single prompt shares with a batch: declared in CellArgs for both, with the same types.
SHARED_WITH_BATCH = frozenset({"model", "system", "temperature", "max_tokens"})


class MagnitudeError(Exception):
    """Shown as one line under the cell, not a traceback."""

    def _render_traceback_(self) -> list[str]:
        return [f"magnitude: {self}"]


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # never SystemExit inside a kernel
        raise MagnitudeError(f"{message} (usage: {self.format_usage().strip().removeprefix('usage: ')})")


def arg(*flags: str, help: str = "", default: Any = None, **spelling: Any) -> Any:
    """A dataclass field that is also a command-line argument (no flags: a positional one)."""
    return field(default=default, metadata={"flags": flags, "help": help, **spelling})


def _value_type(hint: Any) -> tuple[type, bool]:
    """(the scalar type, is it a list) of a field's annotation: `int | None` → (int, False)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(h for h in typing.get_args(hint) if h is not type(None))
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], True
    return hint, False


def add_fields(parser: argparse.ArgumentParser, cls: type) -> None:
    """Each `arg` field of the dataclass as an argument, its type from its annotation."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if "flags" not in f.metadata:
            continue
        meta = dict(f.metadata)
        flags, help_text = meta.pop("flags"), meta.pop("help")
        kind, many = _value_type(hints[f.name])
        if not flags:  # positional
            nargs: dict[str, Any] = {"nargs": "?"} if f.default is not None else {}
            parser.add_argument(f.name, default=f.default, help=help_text, **nargs)
        elif kind is bool:
            parser.add_argument(*flags, dest=f.name, action="store_true", help=help_text)
        else:
            extra: dict[str, Any] = {"nargs": "+"} if many else {}
            extra.update(meta)
            parser.add_argument(*flags, dest=f.name, type=kind, default=f.default, help=help_text, **extra)


def values_of(cls: type, namespace: argparse.Namespace) -> dict[str, Any]:
    return {f.name: getattr(namespace, f.name) for f in fields(cls) if hasattr(namespace, f.name)}


@dataclass(frozen=True)
class CellArgs:
    """`%%magnitude [options]`: one prompt, a conversation turn, a tool-using agent, a comparison,
    embeddings, or (with --df) a DataFrame batch."""

    model: str | None = arg("--model", "-m", help="the model to ask (default: %%magnitude use's, else the server's)")
    system: str | None = arg("--system", "-s", help="system message")
    temperature: float | None = arg("--temperature", "-t", help="0 (default) is greedy")
    max_tokens: int | None = arg("--max-tokens", help="most tokens in the answer")
    top_p: float | None = arg("--top-p", help="nucleus sampling")
    seed: int | None = arg("--seed", help="with a temperature: the same answer again")
    stop: list[str] | None = arg("--stop", help="strings that end the answer")
    format: str = arg(
        "--format", "-f", default="text", choices=FORMATS, help="json parses the answer; code adds a cell"
    )
    output: str | None = arg("-o", "--output", help="variable for the answer (always also _magnitude)")
    no_stream: bool = arg("--no-stream", default=False, help="show the answer once it is complete")
    no_reproducible: bool = arg(
        "--no-reproducible", default=False, help="faster, but the answer may depend on what runs beside it"
    )
    ignore_eos: bool = arg("--ignore-eos", default=False, help="generate exactly --max-tokens (for measuring)")
    chat: str | None = arg("--chat", nargs="?", const=DEFAULT_CHAT, help="continue a named conversation")
    trim: bool = arg("--trim", default=False, help="with --chat: drop the oldest turns when the history overflows")
    df: str | None = arg("--df", help="score this DataFrame, the cell being the row template")
    embed: bool = arg("--embed", default=False, help="unit vectors: one per line of the cell, or with --df one per row")
    compare: str | None = arg("--compare", help="models, comma-separated: the same prompt to each, side by side")
    tools: str | None = arg("--tools", help="functions of the notebook, comma-separated, the model may call")
    max_steps: int = arg("--max-steps", default=5, help="with --tools: rounds of tool calls before it stops")
    tool_choice: str = arg("--tool-choice", default="auto", choices=("auto", "required"), help="with --tools")
    batch: dict[str, Any] = field(default_factory=dict)  # the batch-only options given (see batch_options)

    def validate(self) -> None:
        if self.compare is not None and (self.chat is not None or self.model):
            raise MagnitudeError("--compare names the models itself; it does not combine with --chat or -m")
        if self.tools is not None and (self.compare is not None or self.format != "text" or self.df):
            raise MagnitudeError("--tools answers in text: it does not combine with --compare, -f or --df")
        if self.tools is not None and self.max_steps < 1:
            raise MagnitudeError("--max-steps must be at least 1")

    def batch_options(self) -> dict[str, Any]:
        """Every batch option given, the ones a prompt shares with a batch included."""
        return given_options({**self.batch, **{name: getattr(self, name) for name in SHARED_WITH_BATCH}})

    def batch_only(self) -> list[str]:
        """The batch options given that mean nothing without --df."""
        return sorted(self.batch.keys())


def cell_parser() -> Parser:
    parser = Parser(prog="%%magnitude", add_help=False)
    add_fields(parser, CellArgs)
    add_batch_arguments(parser, skip=SHARED_WITH_BATCH)
    return parser


def parse_cell(argv: list[str]) -> CellArgs:
    namespace = cell_parser().parse_args(argv)
    batch = {name: value for name, value in given_options(namespace).items() if name not in SHARED_WITH_BATCH}
    args = CellArgs(**values_of(CellArgs, namespace), batch=batch)
    args.validate()
    return args


# -- line commands -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LineArgs:
    """One `%magnitude NAME` command; subclasses add its arguments."""

    name: ClassVar[str]
    summary: ClassVar[str]


@dataclass(frozen=True)
class Help(LineArgs):
    name = "help"
    summary = "every option of %%magnitude and every %magnitude command"


@dataclass(frozen=True)
class Status(LineArgs):
    name = "status"
    summary = "the server in a few lines: model, slots, queue, KV cache, tokens/s, cache hits, objectives"
    json: bool = arg("--json", default=False, help="the server's whole /status object instead")


@dataclass(frozen=True)
class ListModels(LineArgs):
    name = "list"
    summary = "the models the server can serve, and which are in memory"


@dataclass(frozen=True)
class Use(LineArgs):
    name = "use"
    summary = "make MODEL the one cells ask for, loading it now"
    model: str = arg(help="a model id, as %magnitude list shows it", default=None)


@dataclass(frozen=True)
class Connect(LineArgs):
    name = "connect"
    summary = "talk to another OpenAI-compatible server"
    url: str = arg(help="the server's URL, ending before /v1", default=None)
    token: str | None = arg("--token", help="its API key")


@dataclass(frozen=True)
class Disconnect(LineArgs):
    name = "disconnect"
    summary = "go back to finding the server automatically"


@dataclass(frozen=True)
class Chats(LineArgs):
    name = "chats"
    summary = "the conversations of this notebook and their turns"


@dataclass(frozen=True)
class History(LineArgs):
    name = "history"
    summary = "one conversation as a DataFrame"
    chat: str = arg(help="the conversation's name", default=DEFAULT_CHAT)


@dataclass(frozen=True)
class Reset(LineArgs):
    name = "reset"
    summary = "forget a conversation"
    chat: str = arg(help="the conversation's name", default=DEFAULT_CHAT)


@dataclass(frozen=True)
class Calibrate(LineArgs):
    name = "calibrate"
    summary = "measure this server: tokens/s, latency percentiles, the knee (a live widget)"
    options: CalibrateOptions = field(default_factory=CalibrateOptions)
    start: bool = arg("--start", default=False, help="start the sweep at once")
    compare: str | None = arg(
        "--compare", help="a profile in the notebook (a variable's name), drawn greyed as the first run to compare with"
    )


@dataclass(frozen=True)
class Batch(LineArgs):
    name = "batch"
    summary = "score a DataFrame with a template over its columns"
    df: str = arg(help="the DataFrame's name in the notebook", default=None)
    template: str = arg("--template", help="the prompt, {column} filled in from each row", required=True)
    output: str | None = arg("-o", "--output", help="variable for the result")
    batch: dict[str, Any] = field(default_factory=dict)


LINE_COMMANDS: dict[str, type[LineArgs]] = {
    cls.name: cls
    for cls in (Help, Status, ListModels, Use, Connect, Disconnect, Chats, History, Reset, Calibrate, Batch)
}


def line_parser() -> Parser:
    parser = Parser(prog="%magnitude", add_help=False)
    sub = parser.add_subparsers(dest="command", parser_class=Parser)
    for name, cls in LINE_COMMANDS.items():
        command = sub.add_parser(name, help=cls.summary, add_help=False)
        add_fields(command, cls)
        if cls is Calibrate:
            add_calibrate_arguments(command)
        if cls is Batch:
            add_batch_arguments(command)
    return parser


def parse_line(argv: list[str]) -> LineArgs:
    if not argv:
        raise MagnitudeError(f"say what to do: {', '.join(LINE_COMMANDS)} (%magnitude help says more)")
    if argv[0] in ("--help", "-h"):
        return Help()
    namespace = line_parser().parse_args(argv)
    cls = LINE_COMMANDS[namespace.command]
    values = values_of(cls, namespace)
    if cls is Calibrate:
        values["options"] = CalibrateOptions.from_values(vars(namespace))
    if cls is Batch:
        values["batch"] = given_options(namespace)
    return cls(**values)


def help_text() -> str:
    """`%magnitude help`: the cell magic's options, then every line command with its own."""
    options = cell_parser().format_help().split("\n", 1)[1].split("options:", 1)[1].rstrip()
    lines = [
        "%%magnitude [options], then the prompt on the lines below ({name} fills in a notebook variable)",
        "Options:" + options,
        "",
        "Line commands:",
    ]
    line = line_parser()
    for action in line._subparsers._group_actions if line._subparsers else []:
        for name, parser in getattr(action, "choices", {}).items():
            lines.append(f"  %magnitude {name:<11} {LINE_COMMANDS[name].summary}")
            if parser._actions:
                lines.append("      " + parser.format_usage().strip().removeprefix("usage: "))
    return "\n".join(lines)
