"""`%%magnitude --df NAME` and `%magnitude batch NAME --template ...`: a DataFrame scored row by row
(pandas through this server, dask on the workers' own engines), or compared across models."""

from __future__ import annotations

import json
from typing import Any

from ..batch.options import BatchError
from ..batch.score import is_dask_dataframe, score_dataframe, summary_line
from .arguments import MagnitudeError
from .session import NotebookSession


def batch_command(
    session: NotebookSession,
    df_name: str,
    template: str,
    options: dict[str, Any],
    output: str | None,
    compare: str | None = None,
) -> Any:
    """Score the DataFrame; `options` are the batch options given (see batch_options)."""
    import pandas as pd

    df = session.dataframe(df_name)
    options = dict(options)
    if options.get("json_schema") is not None:
        options["json_schema"] = _json_schema(session, options["json_schema"])
    if is_dask_dataframe(df):
        result = _dask_batch(df, template, options, compare)
    elif not isinstance(df, pd.DataFrame):
        raise MagnitudeError(f"{df_name!r} is a {type(df).__name__}, not a pandas or dask DataFrame")
    else:
        options.setdefault("model", session.model)
        try:
            if compare is not None:
                from ..batch.compare import compare_dataframe, parse_model_list

                options.pop("model", None)
                result = compare_dataframe(df, template, parse_model_list(compare), client=session.client, **options)
            else:
                origin = session.origin(df_name)
                result = score_dataframe(df, template, client=session.client, origin=origin, **options)
                print("magnitude: " + summary_line(result, options.get("checkpoint")))
        except (BatchError, ValueError) as exc:
            raise MagnitudeError(str(exc)) from None
    session.keep(result, output)
    return None if output else result


def _json_schema(session: NotebookSession, ref: str) -> Any:
    """`--json-schema`: the name of a notebook variable, else JSON text."""
    if ref in session.user_ns:
        return session.user_ns[ref]
    try:
        return json.loads(ref)
    except ValueError:
        raise MagnitudeError(f"--json-schema {ref!r} is neither a variable in the notebook nor JSON text") from None


def _dask_batch(ddf: Any, template: str, options: dict[str, Any], compare: str | None) -> Any:
    """A dask DataFrame: scored on the workers' own engines (register `EnginePlugin` first)."""
    if options.get("model") or compare:
        raise MagnitudeError("a dask DataFrame is scored by the model of each worker's engine: no -m/--compare")
    from ..batch.dask import compute_scored, score_dask_dataframe
    from ..batch.dask import summary_line as dask_summary

    try:
        result = compute_scored(score_dask_dataframe(ddf, template, **options))
    except (BatchError, ValueError, RuntimeError) as exc:
        raise MagnitudeError(str(exc)) from None
    print("magnitude: " + dask_summary(result))
    return result
