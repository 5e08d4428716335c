"""`%%magnitude --embed`: the cell's lines as unit vectors (a numpy array, one row per line), or,
with `--df NAME`, a vector column for every row of a DataFrame (the cell being the row template)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..batch.embed import EMBEDDING_COLUMN, EmbeddingClient, embed_dataframe
from ..batch.options import BatchError, BatchOptions
from ..batch.score import summary_line
from ..client.http import ClientError
from ..options import flag_names
from .arguments import CellArgs, MagnitudeError
from .session import NotebookSession

ALLOWED = frozenset({"model", "output_column", "checkpoint"})  # the batch options that mean something here


class EmbedCellError(ValueError):
    """The cell or its options cannot be embedded; the message is for the notebook's reader."""


@dataclass
class EmbedCell:
    """What one `%%magnitude --embed` cell asks for."""

    text: str
    model: str | None = None
    df: Any = None
    output_column: str = EMBEDDING_COLUMN
    checkpoint: str | None = None


def cell_options(options: dict[str, Any], extra: list[str]) -> dict[str, Any]:
    """The batch options given with --embed; any other option is refused by its flag."""
    flags = flag_names(BatchOptions)
    refused = sorted(flags[name] for name in set(options) - ALLOWED) + extra
    if refused:
        raise EmbedCellError(f"--embed takes -m, --df, --output-column, --checkpoint and -o; not {', '.join(refused)}")
    return options


def run_embed_cell(client: EmbeddingClient, cell: EmbedCell) -> Any:
    """The vectors: an (n, dim) float32 array for the cell's lines, or the DataFrame with its column."""
    try:
        if cell.df is not None:
            result = embed_dataframe(
                cell.df,
                client=client,
                template=cell.text,
                output_column=cell.output_column,
                model=cell.model,
                checkpoint=cell.checkpoint,
            )
            print("magnitude: " + summary_line(result, cell.checkpoint, done_as="embedded"))
            return result
        lines = [line.strip() for line in cell.text.splitlines() if line.strip()]
        if not lines:
            raise EmbedCellError("the cell is empty: write one text per line below %%magnitude --embed")
        vectors = np.stack(client.embed(lines, cell.model))
    except (BatchError, ClientError) as exc:
        raise EmbedCellError(str(exc)) from None
    print(f"magnitude: {len(lines)} text{'s' if len(lines) > 1 else ''} → {vectors.shape[1]}-dimensional unit vectors")
    return vectors


def embed_cell(session: NotebookSession, args: CellArgs, cell: str) -> Any:
    prompt_only = [
        flag
        for flag, given in (
            ("--system", args.system),
            ("--chat", args.chat),
            ("--tools", args.tools),
            ("--compare", args.compare),
            ("-f", args.format != "text"),
        )
        if given
    ]
    try:
        options = cell_options(args.batch_options(), prompt_only)
        df = session.dataframe(args.df) if args.df else None
        request = EmbedCell(
            session.interpolate(cell.strip()) if df is None else cell.strip(),
            model=options.get("model") or session.model,
            df=df,
            output_column=options.get("output_column") or EMBEDDING_COLUMN,
            checkpoint=options.get("checkpoint"),
        )
        result = run_embed_cell(session.client, request)
    except EmbedCellError as exc:
        raise MagnitudeError(str(exc)) from None
    session.keep(result, args.output)
    return None if args.output else result
