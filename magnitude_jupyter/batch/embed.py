"""Embeddings for notebooks and scripts: a DataFrame's rows as vectors, and rows ranked by meaning.

`embed_dataframe` adds a column of unit vectors (float32 numpy arrays) with the batch code's
checkpoint file and progress bar: texts go to the server many per call (the engine batches them
per `llama_decode`), a call that fails is retried row by row so one bad row gets an `error` and the
rest their vectors, and Ctrl-C keeps the finished rows. `most_similar` ranks rows by cosine
similarity to a question (a dot product: the vectors have unit length).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..client.http import ClientError, discover
from .options import BatchError
from .score import Checkpoint, render_prompts

if TYPE_CHECKING:
    import pandas as pd

EMBEDDING_COLUMN = "embedding"
SIMILARITY_COLUMN = "similarity"
BATCH_ROWS = 32  # texts per call: big enough to fill a decode, small enough for a live progress bar


class EmbeddingClient(Protocol):
    def embed(self, inputs: list[str], model: str | None = None) -> list[np.ndarray]: ...


def embedding_key(text: str, model: str | None, column: str) -> str:
    """What made a row's vector: its text, the model and the column it lands in."""
    made_of = {"embed": text, "model": model, "column": column}
    return hashlib.sha256(json.dumps(made_of, sort_keys=True).encode()).hexdigest()[:32]


def _texts(df: pd.DataFrame, column: str | None, template: str | None) -> dict[Any, str]:
    if (column is None) == (template is None):
        raise BatchError("give the column to embed, or a template of the row's columns (not both)")
    if template is not None:
        return render_prompts(df, template)
    if column not in df.columns:
        raise BatchError(f"no column {column!r}; the DataFrame has {', '.join(map(str, df.columns))}")
    return {index: "" if value is None else str(value) for index, value in df[column].items()}


def _embed_rows(client: EmbeddingClient, texts: list[str], model: str | None) -> list[np.ndarray | str]:
    """Vectors for a slice of rows; when the call fails, each row alone, so a bad row fails alone."""
    try:
        return list(client.embed(texts, model))
    except ClientError as exc:
        if len(texts) == 1:
            return [str(exc)]
    return [_embed_rows(client, [text], model)[0] for text in texts]


def embed_dataframe(
    df: pd.DataFrame,
    column: str | None = None,
    client: EmbeddingClient | None = None,
    *,
    template: str | None = None,
    output_column: str = EMBEDDING_COLUMN,
    model: str | None = None,
    checkpoint: str | Path | None = None,
    batch_rows: int = BATCH_ROWS,
    progress: bool = True,
) -> pd.DataFrame:
    """A new DataFrame (the input untouched) with a column of unit vectors and an `error` column.

    Embeds `column`'s text, or `template` (Jinja2 over the row's columns, as `score_dataframe`'s).
    With `checkpoint`, finished rows are appended to a JSONL file and a rerun of the same job
    (same texts, model and column) reuses them.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    if batch_rows < 1:
        raise BatchError(f"batch_rows must be at least 1, got {batch_rows}")
    texts = _texts(df, column, template)
    own_client = client is None
    worker: Any = client if client is not None else discover()
    saved = Checkpoint(checkpoint)
    keys = {index: embedding_key(texts[index], model, output_column) for index in df.index}
    vectors: dict[Any, np.ndarray] = {}
    errors: dict[Any, str] = {}
    for index in df.index:
        record = saved.take(index, keys[index])
        if record is not None:
            vectors[index] = np.asarray(record[output_column], dtype=np.float32)
    reused = len(vectors)
    todo = [index for index in df.index if index not in vectors]
    bar = tqdm(total=len(df), initial=reused, desc="magnitude embed", unit="row", disable=not progress)
    interrupted = False
    try:
        for start in range(0, len(todo), batch_rows):
            rows = todo[start : start + batch_rows]
            for index, result in zip(rows, _embed_rows(worker, [texts[i] for i in rows], model), strict=True):
                if isinstance(result, str):
                    errors[index] = result
                else:
                    vectors[index] = result
                    saved.append(index, keys[index], {output_column: result.tolist()})
            bar.update(len(rows))
            bar.set_postfix(errors=len(errors), refresh=False)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
        if own_client:
            worker.close()
    out = df.copy()
    out[output_column] = pd.Series([vectors.get(i) for i in df.index], index=df.index, dtype=object)
    not_run = "not run (interrupted)"
    out["error"] = pd.Series(
        [errors.get(i, not_run if i not in vectors else None) for i in df.index], index=df.index, dtype=object
    )
    out.attrs["magnitude"] = {
        "interrupted": interrupted,
        "errors": len(errors),
        "skipped_from_checkpoint": reused,
        "checkpoint_unmatched": saved.unmatched,
    }
    return out


def most_similar(
    df: pd.DataFrame,
    query: str,
    *,
    column: str = EMBEDDING_COLUMN,
    top: int | None = 5,
    client: EmbeddingClient | None = None,
    model: str | None = None,
) -> pd.DataFrame:
    """The rows whose vectors (from `embed_dataframe`) are nearest to `query`'s, nearest first,
    with their cosine similarity in a `similarity` column; rows without a vector are left out."""
    if column not in df.columns:
        raise BatchError(f"no column {column!r}: run embed_dataframe first")
    own_client = client is None
    worker: Any = client if client is not None else discover()
    try:
        (question,) = worker.embed([query], model)
    except ClientError as exc:
        raise BatchError(str(exc)) from None
    finally:
        if own_client:
            worker.close()
    embedded = df[df[column].map(lambda v: v is not None)]
    if embedded.empty:
        return embedded.assign(**{SIMILARITY_COLUMN: []})
    matrix = np.stack([np.asarray(v, dtype=np.float32) for v in embedded[column]])
    if matrix.shape[1] != question.shape[0]:
        raise BatchError(
            f"the {column!r} vectors have {matrix.shape[1]} dimensions and the query's {question.shape[0]}: "
            "embed both with the same model"
        )
    ranked = embedded.assign(**{SIMILARITY_COLUMN: matrix @ question}).sort_values(SIMILARITY_COLUMN, ascending=False)
    return ranked if top is None else ranked.head(top)
