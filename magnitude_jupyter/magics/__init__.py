"""`%%magnitude` and `%magnitude`: prompts that stream into the cell, conversations, agents,
embeddings, DataFrame batches and calibration.

The magics talk to a server through `client.py` (ours, found automatically, or any
OpenAI-compatible endpoint after `%magnitude connect URL`); they never touch the engine. Parsing
(`arguments`) gives a typed object; each kind of cell and each line command runs in its own module.
"""

from __future__ import annotations

import shlex
from typing import Any

from IPython.core.magic import Magics, line_cell_magic, magics_class

from . import chat_commands, server_commands
from .arguments import (
    LINE_COMMANDS,
    Batch,
    Calibrate,
    CellArgs,
    Chats,
    Connect,
    Disconnect,
    Help,
    History,
    LineArgs,
    ListModels,
    MagnitudeError,
    Reset,
    Status,
    Use,
    cell_parser,
    help_text,
    line_parser,
    parse_cell,
    parse_line,
)
from .session import LAST_ANSWER, NotebookSession

__all__ = [
    "LAST_ANSWER",
    "LINE_COMMANDS",
    "MagnitudeError",
    "MagnitudeMagics",
    "cell_parser",
    "help_text",
    "line_parser",
    "load_ipython_extension",
]


@magics_class
class MagnitudeMagics(Magics):
    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.session = NotebookSession(shell)

    def remember_cell(self, info: Any) -> None:
        self.session.cell_key = getattr(info, "cell_id", None) or getattr(info, "raw_cell", "") or ""

    @line_cell_magic
    def magnitude(self, line: str, cell: str | None = None) -> Any:
        """%%magnitude [options]: send the cell as a prompt.  %magnitude help: every option and command."""
        try:
            argv = shlex.split(line)
        except ValueError as exc:
            raise MagnitudeError(f"cannot parse the options: {exc}") from None
        if cell is None:
            return self.run_line(parse_line(argv))
        if "--help" in argv or "-h" in argv:
            print(help_text())
            return None
        return self.run_cell(parse_cell(argv), cell)

    def run_cell(self, args: CellArgs, cell: str) -> Any:
        if args.embed:
            from .embed_cell import embed_cell

            return embed_cell(self.session, args, cell)
        if args.df:
            from .batch_command import batch_command

            return batch_command(self.session, args.df, cell.strip(), args.batch_options(), args.output, args.compare)
        if args.batch_only():
            from ..batch.options import BatchOptions
            from ..options import flag_names

            names = flag_names(BatchOptions)
            flags = ", ".join(names[name] for name in args.batch_only())
            raise MagnitudeError(f"{flags} score a DataFrame (with --df); for one prompt use -f json for JSON")
        from .prompt_cell import prompt_cell

        return prompt_cell(self.session, args, cell)

    def run_line(self, args: LineArgs) -> Any:
        session = self.session
        match args:
            case Help():
                print(help_text())
            case Status():
                server_commands.status(session, args)
            case ListModels():
                server_commands.list_models(session)
            case Use():
                server_commands.use(session, args)
            case Connect():
                server_commands.connect(session, args)
            case Disconnect():
                server_commands.disconnect(session)
            case Chats():
                chat_commands.chats(session)
            case History():
                return chat_commands.history(session, args)
            case Reset():
                chat_commands.reset(session, args)
            case Calibrate():
                from .calibrate_command import calibrate_command

                return calibrate_command(session, args)
            case Batch():
                from .batch_command import batch_command

                return batch_command(session, args.df, args.template, args.batch, args.output)
            case _:
                raise MagnitudeError(f"unknown command {args.name!r}")
        return None


def load_ipython_extension(ipython: Any) -> None:
    magics = MagnitudeMagics(ipython)
    ipython.register_magics(magics)
    ipython.events.register("pre_run_cell", magics.remember_cell)
