"""Side by side: one prompt (or one DataFrame template) sent to several models, their answers and
figures together. `%%magnitude --compare a,b` and `--df DF --compare a,b` are built on this."""

from __future__ import annotations

import html
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..client.http import Client, ClientError, StreamResult

if TYPE_CHECKING:
    import pandas as pd


@dataclass
class ModelAnswer:
    model: str
    text: str = ""
    completion_tokens: int | None = None
    ttft_ms: float | None = None
    tokens_per_s: float | None = None  # generated tokens / wall time after the first token
    finish_reason: str | None = None
    error: str | None = None


def parse_model_list(text: str) -> list[str]:
    models = [m.strip() for m in text.split(",") if m.strip()]
    if len(models) < 2 or len(set(models)) != len(models):
        raise ValueError(f"--compare takes two or more different models, comma-separated; got {text!r}")
    return models


def _answer(client: Client, model: str, messages: list[dict[str, Any]], body: dict[str, Any]) -> ModelAnswer:
    result = StreamResult()
    started = time.monotonic()
    first: float | None = None
    try:
        for _ in client.stream_chat(messages, result=result, **{**body, "model": model}):
            first = first or time.monotonic()
    except ClientError as exc:
        return ModelAnswer(model, error=str(exc))
    ended = time.monotonic()
    tokens = (result.usage or {}).get("completion_tokens")
    timings = result.timings or {}
    server_ttft = timings.get("ttft_ms")
    ttft = float(server_ttft) if server_ttft is not None else ((first or ended) - started) * 1000
    rate = timings.get("decode_tokens_per_s")
    if rate is None and tokens and first and ended > first:
        rate = (tokens - 1) / (ended - first)
    return ModelAnswer(
        model=result.model or model,
        text=result.text,
        completion_tokens=tokens,
        ttft_ms=round(ttft, 1),
        tokens_per_s=round(rate, 1) if rate else None,
        finish_reason=result.finish_reason,
    )


def compare_prompt(
    client: Client, models: list[str], messages: list[dict[str, Any]], body: dict[str, Any]
) -> list[ModelAnswer]:
    """The same messages to every model at once; answers in the order the models were named."""
    with ThreadPoolExecutor(max_workers=len(models)) as workers:
        return list(workers.map(lambda m: _answer(client, m, messages, body), models))


def answers_html(answers: list[ModelAnswer]) -> str:
    """A small table, one column per model: the answer, then its figures."""

    def cell(value: Any, fmt: str = "{}") -> str:
        return "" if value is None else html.escape(fmt.format(value))

    head = "".join(f"<th>{html.escape(a.model)}</th>" for a in answers)
    texts = "".join(
        f"<td style='white-space:pre-wrap;vertical-align:top;text-align:left'>"
        f"{html.escape(a.text) if a.error is None else '<b>error</b>: ' + html.escape(a.error)}</td>"
        for a in answers
    )
    rows = [f"<tr><th></th>{head}</tr>", f"<tr><th>answer</th>{texts}</tr>"]
    for label, key, fmt in (
        ("tokens", "completion_tokens", "{}"),
        ("TTFT", "ttft_ms", "{:,.0f} ms"),
        ("tok/s", "tokens_per_s", "{:.1f}"),
        ("finish", "finish_reason", "{}"),
    ):
        rows.append(f"<tr><th>{label}</th>{''.join(f'<td>{cell(getattr(a, key), fmt)}</td>' for a in answers)}</tr>")
    return f"<table class='magnitude-compare'>{''.join(rows)}</table>"


def answers_text(answers: list[ModelAnswer]) -> str:
    parts = []
    for a in answers:
        figures = f"{a.completion_tokens} tokens, TTFT {a.ttft_ms} ms, {a.tokens_per_s} tok/s"
        parts.append(f"== {a.model} ({figures})\n{a.text if a.error is None else 'error: ' + a.error}")
    return "\n\n".join(parts)


def answers_frame(answers: list[ModelAnswer]) -> pd.DataFrame:
    import pandas as pd

    return pd.DataFrame([asdict(a) for a in answers]).set_index("model")


def compare_dataframe(
    df: pd.DataFrame, template: str, models: list[str], client: Client | None = None, **options: Any
) -> pd.DataFrame:
    """Score the DataFrame once per model: the input's columns, then one answer column per model
    (`answer[model]`, and `error[model]` where a row failed). Each model keeps its own checkpoint
    file (`name.<model>.jsonl`), so a rerun reuses each model's finished rows."""
    from .score import score_dataframe

    result = df.copy()
    column = options.get("output_column") or "answer"
    checkpoint = options.pop("checkpoint", None)
    for model in models:
        per_model = dict(options, model=model)
        if checkpoint is not None:
            path = Path(checkpoint)
            per_model["checkpoint"] = path.with_name(f"{path.stem}.{model}{path.suffix or '.jsonl'}")
        scored = score_dataframe(df, template, client=client, **per_model)
        result[f"{column}[{model}]"] = scored[column]
        if scored["error"].notna().any():
            result[f"error[{model}]"] = scored["error"]
    return result
