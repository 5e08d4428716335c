"""The magics' arguments, declared once as typed objects: each dataclass's fields make its argparse
parser and `%magnitude help`, and parsing gives back an instance of it, never a raw Namespace.

`%%magnitude` parses into `CellArgs`; `%magnitude NAME ...` into the `LineArgs` subclass that
`LINE_COMMANDS` registers for NAME. Each field is an `options.option`, as every setting of the
package is; batch options (`--df`, `%magnitude batch`) come from `batch.options.BatchOptions` and
calibration options from `calibrate.options.CalibrateOptions`, the same declarations the CLI uses.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, NoReturn

from ..batch.options import BatchOptions, given_options
from ..calibrate.options import CalibrateOptions
from ..client.conversations import DEFAULT_CHAT
from ..options import add_arguments, option

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


def values_of(cls: type, namespace: argparse.Namespace) -> dict[str, Any]:
    return {f.name: getattr(namespace, f.name) for f in fields(cls) if hasattr(namespace, f.name)}


@dataclass(frozen=True)
class CellArgs:
    """`%%magnitude [options]`: one prompt, a conversation turn, a tool-using agent, a comparison,
    embeddings, or (with --df) a DataFrame batch."""

    model: str | None = option(
        None, "the model to ask (default: %%magnitude use's, else the server's)", "--model", "-m"
    )
    system: str | None = option(None, "system message", "--system", "-s")
    temperature: float | None = option(None, "0 (default) is greedy", "--temperature", "-t")
    max_tokens: int | None = option(None, "most tokens in the answer")
    top_p: float | None = option(None, "nucleus sampling")
    seed: int | None = option(None, "with a temperature: the same answer again")
    stop: list[str] | None = option(None, "strings that end the answer")
    format: str = option("text", "json parses the answer; code adds a cell", "--format", "-f", choices=FORMATS)
    output: str | None = option(None, "variable for the answer (always also _magnitude)", "-o", "--output")
    no_stream: bool = option(False, "show the answer once it is complete")
    no_reproducible: bool = option(False, "faster, but the answer may depend on what runs beside it")
    ignore_eos: bool = option(False, "generate exactly --max-tokens (for measuring)")
    chat: str | None = option(None, "continue a named conversation", nargs="?", const=DEFAULT_CHAT)
    trim: bool = option(False, "with --chat: drop the oldest turns when the history overflows")
    df: str | None = option(None, "score this DataFrame, the cell being the row template")
    embed: bool = option(False, "unit vectors: one per line of the cell, or with --df one per row")
    compare: str | None = option(None, "models, comma-separated: the same prompt to each, side by side")
    tools: str | None = option(None, "functions of the notebook, comma-separated, the model may call")
    max_steps: int = option(5, "with --tools: rounds of tool calls before it stops")
    tool_choice: str = option("auto", "with --tools", choices=("auto", "required"))
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
    add_arguments(parser, CellArgs)
    add_arguments(parser, BatchOptions, skip=SHARED_WITH_BATCH, unset_is_none=True)
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
    json: bool = option(False, "the server's whole /status object instead")


@dataclass(frozen=True)
class ListModels(LineArgs):
    name = "list"
    summary = "the models the server can serve, and which are in memory"


@dataclass(frozen=True)
class Use(LineArgs):
    name = "use"
    summary = "make MODEL the one cells ask for, loading it now"
    model: str = option(None, "a model id, as %magnitude list shows it", positional=True)


@dataclass(frozen=True)
class Connect(LineArgs):
    name = "connect"
    summary = "talk to another OpenAI-compatible server"
    url: str = option(None, "the server's URL, ending before /v1", positional=True)
    token: str | None = option(None, "its API key")


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
    chat: str = option(DEFAULT_CHAT, "the conversation's name", positional=True)


@dataclass(frozen=True)
class Reset(LineArgs):
    name = "reset"
    summary = "forget a conversation"
    chat: str = option(DEFAULT_CHAT, "the conversation's name", positional=True)


@dataclass(frozen=True)
class Calibrate(LineArgs):
    name = "calibrate"
    summary = "measure this server: tokens/s, latency percentiles, the knee (a live widget)"
    options: CalibrateOptions = field(default_factory=CalibrateOptions)
    start: bool = option(False, "start the sweep at once")
    compare: str | None = option(
        None, "a profile in the notebook (a variable's name), drawn greyed as the first run to compare with"
    )


@dataclass(frozen=True)
class Batch(LineArgs):
    name = "batch"
    summary = "score a DataFrame with a template over its columns"
    df: str = option(None, "the DataFrame's name in the notebook", positional=True)
    template: str = option(None, "the prompt, {column} filled in from each row", required=True)
    output: str | None = option(None, "variable for the result", "-o", "--output")
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
        add_arguments(command, cls)
        if cls is Calibrate:
            add_arguments(command, CalibrateOptions)
        if cls is Batch:
            add_arguments(command, BatchOptions, unset_is_none=True)
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
